"""The vLLM rollout backend (fastrehearse/rollout/backends/vllm_backend.py) on the real vllm(-cpu) package:
one vLLM instance for the whole module (its start-up dominates: ~40-60 s on 2 CPU cores with
enforce_eager), a tiny random Llama in fp32.

  * the segment protocol: a stop string ends a segment at exactly the token HF's greedy decode
    completes it with, reported as the stop; max_tokens cuts; log-probs of the sampled tokens;
  * greedy episodes through the engine equal the HF backend's, token for token (forced turns,
    rehearsed responses, real responses, prefix caching across segments);
  * weight sync: after an optimizer step, vLLM's log-probs of a fixed sequence equal the trainer's
    compute_logprobs of the updated model and differ from the pre-update ones;
  * bad input: vLLM missing -> one line naming the package; a KV cache too small for
    max_episode_tokens -> refused before start-up, naming VLLM_CPU_KVCACHE_SPACE.
"""
import copy
import importlib.util
import math

import pytest
import torch

from fastrehearse.data import Episode
from fastrehearse.kernels.roles import Role
from fastrehearse.model import RehearsalModel, load_model, use_varlen_attention
from fastrehearse.model.loader import TinyModelOptions
from fastrehearse.packing import build_packed_batch
from fastrehearse.rollout import RolloutConfig, RolloutEngine
from fastrehearse.rollout.backends.segments import Sampling, SegmentRequest
from fastrehearse.rollout.backends.vllm_options import VLLMOptions
from fastrehearse.rollout.engine.policy import ScriptedPolicy
from fastrehearse.rollout.text.template import ChatTemplate, format_tool_call
from _rollout_fixtures import CalcEnv, calc_tasks

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")]

# Tolerance of log-probs between backends and against the trainer, fp32, this tiny Llama: measured
# max |diff| 8.6e-6 (vLLM vs HF engine, 144 greedy tokens), 9.8e-6 (HF KV-cache decode vs one plain
# forward), 8.6e-6 (vLLM vs plain forward): different attention kernels and reduction orders. 1e-4
# leaves a 10x margin for other CPUs; the optimizer step in the sync test moves them by > 1e-2.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    # head_dim 64 (vLLM-CPU attention has no kernel for 16); weights of std 0.2: a greedy decode that
    # varies (at std 0.02 it repeats one token), with top-2 logit gaps far above the backends' fp
    # differences (measured below 1e-5), so no greedy choice flips
    model, tok = load_model("tiny-llama", options=TinyModelOptions(hidden_size=128, num_heads=2, num_kv_heads=1,
                                                                  initializer_range=0.2))
    return model, tok, ChatTemplate(tok)


@pytest.fixture(scope="module")
def vllm_backend(tiny):
    """The process's shared instance (what RolloutEngine(config.backend="vllm") and the eval CLI
    find for this model object), started once for the module."""
    import psutil
    from fastrehearse.rollout.backends.vllm_backend import close_shared, shared_backend
    model, tok, _ = tiny
    served = copy.deepcopy(model)     # the weight-sync test updates it (and restores it)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    state = (torch.get_rng_state(), torch.get_num_threads(), torch.set_num_threads)
    group = torch.distributed.is_initialized()     # another test module may have left one
    b = shared_backend(served, tok, RolloutConfig(max_episode_tokens=1024,
                                                  vllm=VLLMOptions(kv_cache_gib=1, enforce_eager=True)))
    b.started_with = {"new_children": [c.pid for c in psutil.Process().children(recursive=True)
                                       if c.pid not in before],
                      "state_before": state, "group": group,
                      "state_after": (torch.get_rng_state(), torch.get_num_threads(), torch.set_num_threads)}
    yield b
    close_shared()


def test_engine_runs_in_process_and_leaves_its_state(vllm_backend):
    """The engine lives in the calling process (no engine process that could be orphaned: nothing
    to clean up after a SIGKILL), and its start-up leaves the process's RNG state, thread count
    and torch.set_num_threads as they were (vLLM re-seeds and replaces the latter in-process)."""
    st = vllm_backend.started_with
    assert st["new_children"] == []
    (rng0, n0, fn0), (rng1, n1, fn1) = st["state_before"], st["state_after"]
    assert torch.equal(rng0, rng1) and n0 == n1 and fn0 is fn1
    executor = "ExecutorWithExternalLauncher" if st["group"] else "UniProcExecutor"
    assert vllm_backend.external is st["group"] and type(vllm_backend.engine.model_executor).__name__ == executor


def _hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_segment_stops_at_the_stop_string_and_at_max_tokens(tiny, vllm_backend):
    from collections import Counter
    model, tok, tmpl = tiny
    prompt = tmpl.render_prompt([{"role": "user", "content": "Add 2 and 3."}]).input_ids
    ref = _hf_greedy(model, prompt, 12)
    # a stop string completed by the 6th greedy token (and by none before it)
    k = next(i for i in range(5, 12) if tok.decode(ref[i:i + 1]).strip()
             and tok.decode(ref[i:i + 1]) not in tok.decode(ref[:i]))
    marker = tok.decode(ref[k:k + 1])
    stats = Counter()
    s = vllm_backend.session(Sampling(temperature=0.0), stats)
    s.add([SegmentRequest(0, prompt, [0] * len(prompt), Role.ACT, 12, (marker,), frozenset()),
           SegmentRequest(1, prompt, [0] * len(prompt), Role.ACT, 3, (), frozenset())])
    got = {}
    while len(got) < 2:
        got.update(s.step())
    s.close()
    assert got[0].tokens == ref[:k + 1] and got[0].stop == marker
    assert got[1].tokens == ref[:3] and got[1].stop is None
    with torch.no_grad():    # greedy log-probs: log_softmax(logits) of each sampled token
        logits = model(torch.tensor([prompt + ref[:k + 1]])).logits[0, len(prompt) - 1:-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ref[:k + 1])[:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(got[0].logprobs, want.tolist())) < LOGPROB_TOL
    assert stats["decode_tokens"] == k + 1 + 3


@pytest.mark.parametrize("mode", ["rehearse", "real"])
def test_greedy_episodes_equal_the_hf_backend(tiny, vllm_backend, mode):
    """The same episodes, token for token: forced agent turns with calls, model-written (rehearsed)
    or executed (real) responses, text replies; several segments per episode on the prefix cache."""
    model, tok, tmpl = tiny
    call = format_tool_call("add", {"a": 2, "b": 3})
    policy = ScriptedPolicy([call, None, call])     # turn 2: the model writes it (greedy)
    cfg = RolloutConfig(mode=mode, temperature=0.0, max_new_tokens=12, max_turns=4, max_episode_tokens=1024)
    hf = RolloutEngine(model, tok, cfg, template=tmpl).rollout(calc_tasks(3), CalcEnv, group_size=2, seed=1,
                                                               policy=policy)
    vl = RolloutEngine(model, tok, cfg, template=tmpl, backend=vllm_backend).rollout(
        calc_tasks(3), CalcEnv, group_size=2, seed=1, policy=policy)
    assert vl.metrics["backend"] == "vllm" and hf.metrics["backend"] == "hf"
    sampled = 0
    for a, b in zip(hf.episodes, vl.episodes):
        assert a.input_ids == b.input_ids and a.roles == b.roles
        assert a.metadata["stop_reason"] == b.metadata["stop_reason"]
        for x, y in zip(a.rollout_logprobs, b.rollout_logprobs):
            assert math.isnan(x) == math.isnan(y)
            if not math.isnan(x):
                assert abs(x - y) < LOGPROB_TOL
                sampled += 1
    assert sampled > 50
    assert vl.metrics["prefill_reused_tokens"] > 0       # later segments hit the prefix cache


def test_weight_sync_serves_the_updated_model(tiny, vllm_backend):
    """After an optimizer step and sync_weights, vLLM's log-probs of a fixed token sequence equal
    the trainer's compute_logprobs of the updated model, and differ from the pre-update ones."""
    from fastrehearse.train.config import TrainConfig
    from fastrehearse.train.update import compute_logprobs
    _, tok, _ = tiny
    model = vllm_backend.model_ref
    saved = copy.deepcopy(model.state_dict())
    ids = torch.randint(3, len(tok), (61,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = build_packed_batch([Episode(input_ids=ids, roles=[int(Role.ACT)] * len(ids), task_id="t")], [0])
    keep = (batch.roles != 0)

    def trainer_lp():
        trained = copy.deepcopy(model)
        use_varlen_attention(trained)
        return compute_logprobs(RehearsalModel(trained), [batch], TrainConfig())[0][keep].double()

    before = torch.tensor(vllm_backend.logprobs_of([ids])[0], dtype=torch.float64)
    assert float((before - trainer_lp()).abs().max()) < LOGPROB_TOL
    try:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        logits = model(torch.tensor([ids])).logits[0, :-1]
        torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).backward()
        opt.step()
        secs = vllm_backend.sync_weights(model)
        # streamed, not written: the engine's folder holds config and tokenizer only
        assert not [f for f in vllm_backend.dir.iterdir() if f.suffix in (".safetensors", ".bin", ".pt")]
        tied_extra = model.get_input_embeddings().weight if model.config.tie_word_embeddings else None
        assert vllm_backend.last_sync_bytes == sum(p.numel() * 4 for p in model.parameters()) + (
            tied_extra.numel() * 4 if tied_extra is not None else 0)
        after = torch.tensor(vllm_backend.logprobs_of([ids])[0], dtype=torch.float64)
        ref = trainer_lp()
        assert float((after - ref).abs().max()) < LOGPROB_TOL
        assert float((after - before).abs().max()) > 100 * LOGPROB_TOL
        assert secs > 0
    finally:
        model.load_state_dict(saved)
        vllm_backend.sync_weights(model)
    restored = torch.tensor(vllm_backend.logprobs_of([ids])[0], dtype=torch.float64)
    assert float((restored - before).abs().max()) < LOGPROB_TOL


def test_vllm_missing_is_one_line_naming_the_package(tiny, monkeypatch):
    from fastrehearse.rollout.backends import vllm_backend as vb
    model, tok, tmpl = tiny
    real = importlib.util.find_spec
    monkeypatch.setattr(vb.importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a))
    with pytest.raises(vb.VLLMUnavailable) as e:
        RolloutEngine(model, tok, RolloutConfig(backend="vllm"), template=tmpl)
    assert "vllm" in str(e.value) and "\n" not in str(e.value)


def test_kv_cache_too_small_is_refused_before_start(tiny):
    from fastrehearse.rollout.backends.vllm_backend import VLLMBackend, VLLMStartError, kv_bytes_per_token
    model, tok, _ = tiny
    too_many = (1 << 30) // kv_bytes_per_token(model) + 1
    with pytest.raises(VLLMStartError) as e:
        VLLMBackend(model, tok, max_episode_tokens=too_many, options=VLLMOptions(kv_cache_gib=1))
    assert "VLLM_CPU_KVCACHE_SPACE" in str(e.value) and "kv_cache_gib" in str(e.value)
    with pytest.raises(ValueError, match="kv_cache_gib"):
        RolloutConfig(backend="vllm", vllm=VLLMOptions(kv_cache_gib=0)).validate()
    with pytest.raises(ValueError, match="logits_processor"):
        RolloutEngine(model, tok, RolloutConfig(backend="vllm"), logits_processor=lambda *a: a[-1])


def test_eval_cli_backends_agree_per_item(tiny, vllm_backend, tmp_path):
    """`fastrehearse eval --backend hf|vllm`, greedy, the same model: the same per-item scores and
    generated-token counts; results.json records backend, backend_startup_s and rollout_s."""
    from fastrehearse.eval import cli
    _, tok, _ = tiny
    served = vllm_backend.model_ref
    res = {}
    for backend in ("hf", "vllm"):
        args = cli.build_parser().parse_args([
            "--suite", "builtin", "--policy", "tiny-llama", "--limit", "3", "--max-new-tokens", "16",
            "--max-turns", "2", "--max-episode-tokens", "1024", "--quiet", "--backend", backend,
            "--out", str(tmp_path / backend)])
        res[backend] = cli.run(args, loaded=(served, tok))
        assert res[backend]["backend"] == backend and res[backend]["rollout_s"] > 0
    assert res["hf"]["backend_startup_s"] == 0.0
    assert res["vllm"]["backend_startup_s"] == round(vllm_backend.startup_s, 2)   # the shared instance
    items = {b: sorted((r["id"], r["score"], r["gen_tokens"], r["steps"])
                       for r in _items(tmp_path / b)) for b in res}
    assert items["hf"] == items["vllm"] and len(items["hf"]) == 3


def _items(out):
    import json
    return [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines() if line.strip()]


def test_training_on_vllm_syncs_weights_and_logs_tis(tmp_path):
    """`fastrehearse train` with rollout.backend=vllm (its own process and vLLM instance): SFT steps
    then RL steps; every step records weight_sync_s, RL steps the truncated-IS ratio, which stays 1
    to ~1e-6 after the SFT updates -- vLLM sampled from the trainer's current weights. With a KL
    term and the smoke preset's entropy bonus beside TIS (TIS weights the policy-gradient term
    alone; the combination used to be refused)."""
    import json
    import os
    import subprocess
    import sys
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "fastrehearse.cli", "train", "--config", "configs/smoke.yaml",
         "--set", f"run_dir={run}", "--set", "rollout.backend=vllm", "--set", "model.options.hidden_size=128",
         "--set", "model.options.num_heads=2", "--set", "model.options.num_kv_heads=1",
         "--set", "rollout.vllm.enforce_eager=true", "--set", "rollout.vllm.kv_cache_gib=1",
         "--set", "checkpoint.export=false", "--set", "algo.loss.kl_coef=0.01", "--set", "eval.num_tasks=0",
         "--set", "steps=2"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True, text=True,
        timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "stage" in r]
    assert [r["stage"] for r in steps] == ["sft", "sft", "rl", "rl"]
    assert all(r["weight_sync_s"] > 0 for r in steps)
    for r in steps[2:]:
        assert abs(r["tis_ratio_mean"] - 1) < 1e-3 and r["tis_ratio_max"] < 1.01
        assert any("kl" in k for k in r), sorted(r)          # the KL term ran beside TIS
