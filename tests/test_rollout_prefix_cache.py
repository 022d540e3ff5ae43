"""Prefix KV reuse and duplicate-prompt prefill in HFGenerator: every start/step/keep sequence gives
the logits of the plain generator (fresh prefill per row), the cache stores and evicts what its
docstring says, models with a sliding-window layer never use it, and test-time rehearsal with the
cache commits the same episodes as without it while prefilling far fewer tokens."""
import pytest
import torch

from fastrehearse.rollout.backends.generator import HFGenerator
from fastrehearse.rollout.backends.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    from fastrehearse.model import build_tiny_model
    return build_tiny_model("llama", vocab_size=97, seed=0, num_layers=3, initializer_range=0.2)


def _rand(n, seed):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(a, b):
    # same tokens, same positions: only the rounding of differently shaped fp32 GEMMs differs
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _run(gen, prompts, steps, keeps):
    out = [gen.start(prompts)]
    for feed, keep in zip(steps, keeps):
        if keep is not None:
            gen.keep(keep)
        out.append(gen.step(feed))
    return out


def test_generator_with_cache_matches_fresh_prefill(model):
    base = _rand(40, 1)
    ext = base + _rand(9, 2)
    other = _rand(17, 3)
    pc = PrefixCache(1 << 30)
    warm = HFGenerator(model, prefix_cache=pc)
    warm.start([base[:25], other[:4], _rand(6, 4)])         # cached prefixes of different lengths
    assert len(pc) == 3 and pc.computed_tokens == 35 and pc.reused_tokens == 0
    # rows: extends a cached prompt, repeats a cached prefix exactly, extends by one token, new,
    # a duplicate row
    prompts = [ext, base[:25], other[:5], _rand(11, 5), ext]
    steps = [[[1], [2, 3], [4], [5, 6, 7], [8]], [[9], [10, 11, 12], [13]], [[14, 15], [16]]]
    keeps = [None, [0, 2, 4], [2, 0]]
    ref = _run(HFGenerator(model), prompts, steps, keeps)
    got_gen = HFGenerator(model, prefix_cache=pc)
    got = _run(got_gen, prompts, steps, keeps)
    for a, b in zip(got, ref):
        _close(a, b)
    # prefilled: ext 49-25, base[:25] only its last token, other[:5] 1, the new prompt 11,
    # the duplicate nothing
    assert pc.computed_tokens - 35 == 24 + 1 + 1 + 11
    assert got_gen.reused_tokens == sum(map(len, prompts)) - 37
    # a later start extending a stored prompt reuses all of it
    again = HFGenerator(model, prefix_cache=pc)
    _close(again.start([ext + [3, 4]]), HFGenerator(model).start([ext + [3, 4]]))
    assert again.reused_tokens == len(ext)


def test_duplicate_prompts_prefill_once(model):
    p, q = _rand(30, 6), _rand(12, 7)
    prompts = [p, q, p, p]
    steps = [[[1], [2], [3, 4], [5]], [[6], [7], [8]]]
    keeps = [None, [3, 1, 0]]
    dd = HFGenerator(model)
    got = _run(dd, prompts, steps, keeps)
    assert dd.reused_tokens == 60
    ref = _run(HFGenerator(model, dedupe=False), prompts, steps, keeps)
    for a, b in zip(got, ref):
        _close(a, b)


def test_prefix_cache_store_rules():
    def kv(n, fill=0.0):   # one layer, [1, heads=2, n, dim=4] fp32: 64 bytes per token
        return [(torch.full((1, 2, n, 4), fill), torch.full((1, 2, n, 4), fill))]
    pc = PrefixCache(64 * 20)
    assert pc.put([1, 2, 3], kv(3))
    assert pc.put([1, 2, 3, 4, 5], kv(5))          # covers [1, 2, 3]: replaced
    assert len(pc) == 1 and pc.nbytes == 64 * 5
    assert pc.put([1, 2], kv(2)) and len(pc) == 1  # a prefix of a stored entry: nothing added
    n, got = pc.match([1, 2, 3, 4, 9, 9])
    assert n == 4 and got[0][0].shape[2] == 5
    assert pc.match([7, 1, 2]) == (0, None)
    assert pc.put([7] * 10, kv(10)) and len(pc) == 2
    assert pc.put([8] * 8, kv(8))                  # 5 + 10 + 8 > 20 tokens: the oldest goes
    assert pc.match([1, 2, 3])[0] == 0 and pc.evicted == 1 and pc.nbytes == 64 * 18
    pc.match([7])                                  # [7]*10 is now the most recent
    assert pc.put([6] * 5, kv(5)) and pc.match([7] * 3)[0] == 3 and pc.match([8])[0] == 0
    assert not pc.put([5] * 21, kv(21))            # alone over the budget
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="max_bytes"):
            PrefixCache(bad)


def test_sliding_window_models_never_use_the_cache():
    from transformers import AutoModelForCausalLM

    from fastrehearse.model import build_tiny_model
    from fastrehearse.model.loader import tiny_config
    full = build_tiny_model("qwen3", vocab_size=97, seed=0)
    cfg = tiny_config("qwen3", vocab_size=97, layer_types=["full_attention", "sliding_attention"])
    cfg.use_sliding_window, cfg.sliding_window = True, 8
    mixed = AutoModelForCausalLM.from_config(cfg).eval()
    assert PrefixCache.supports(full) and not PrefixCache.supports(mixed)
    pc = PrefixCache(1 << 20)
    g = HFGenerator(mixed, prefix_cache=pc)
    assert g.prefix_cache is None
    p = _rand(20, 8)
    _close(g.start([p, p + [1]]), HFGenerator(mixed, dedupe=False).start([p, p + [1]]))
    assert len(pc) == 0


@pytest.fixture(scope="module")
def tiny_tok():
    from fastrehearse.model import build_tiny_model, load_tokenizer
    from fastrehearse.model.loader import _sync_special_tokens
    tok = load_tokenizer("smollm2")
    m = build_tiny_model("llama", vocab_size=len(tok), seed=0, initializer_range=0.2)
    _sync_special_tokens(m, tok)
    return m, tok


@pytest.mark.parametrize("form,mode", [("select", "parallel"), ("memory", "sequential")])
def test_rehearsal_with_cache_commits_the_same_episodes(tmp_path, tiny_tok, form, mode):
    """The same builtin items through test-time rehearsal with and without the prefix cache:
    identical committed tokens; the cached run reuses most of its private prompt tokens."""
    from fastrehearse.envs.builtin import BuiltinSuite
    from fastrehearse.eval.harness import HarnessConfig, run_items
    from fastrehearse.eval.rehearsal import RehearsalPolicy
    from fastrehearse.eval.results import ResultStore
    from fastrehearse.eval.runner import EvalSettings, eval_engine

    model, tok = tiny_tok
    suite = BuiltinSuite()
    tasks = suite.tasks("test", 2)
    out = {}
    for name, nbytes in (("off", 0), ("on", 1 << 28)):
        pol = RehearsalPolicy(model, tok, 2, form=form, mode=mode, max_new_tokens=8, assess_tokens=6,
                              prefix_cache_bytes=nbytes)
        assert (pol.prefix_cache is None) == (nbytes == 0)
        engine = eval_engine(model, tok, EvalSettings(max_turns=3, max_new_tokens=8), policy=pol)
        # the committed engine reads the rehearsals' cache exactly when there is one
        assert engine.backend_factory().prefix_cache is pol.prefix_cache
        done = run_items([("test", t) for t in tasks], lambda c: suite.make_env(), engine, pol,
                         ResultStore(tmp_path / name, {}), HarnessConfig(batch_size=2))
        assert all(r.error is None for r in done), [r.error for r in done]
        out[name] = (done, pol)
    off, on = out["off"][0], out["on"][0]
    assert [r.key for r in off] == [r.key for r in on]
    for a, b in zip(off, on):
        assert (a.score, a.steps, a.gen_tokens, a.rehearsal_tokens, a.extra) == \
               (b.score, b.steps, b.gen_tokens, b.rehearsal_tokens, b.extra)
    # every rehearsed turn's second private prompt (select: the greedy candidate after the drafts;
    # sequential: draft 2 after draft 1) reuses at least the item's whole context but one token
    engine = eval_engine(model, tok, EvalSettings(max_turns=3, max_new_tokens=8))
    first = sum(len(engine.prompt_for(t, suite.make_env(), 0).input_ids) - 1 for t in tasks)
    st = out["on"][1].prefix_cache.stats()
    assert st["reused_tokens"] >= first, st


def test_bad_prefix_cache_settings_are_refused(tiny_tok, tmp_path):
    from fastrehearse.eval import cli
    from fastrehearse.eval.rehearsal import RehearsalPolicy
    model, tok = tiny_tok
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        RehearsalPolicy(model, tok, 1, prefix_cache_bytes=-1)
    for bad, msg in (("-1", "must be >= 0, got -1.0"), ("nan", "must be >= 0, got nan"),
                     ("inf", "must be finite")):
        with pytest.raises(cli.UsageError, match=f"--rehearsal-cache-gib {msg}"):
            cli.run(cli.build_parser().parse_args(["--suite", "builtin", "--policy", "smollm2", "--limit", "1",
                                                   "--rehearsal-budget", "1", "--rehearsal-cache-gib", bad,
                                                   "--out", str(tmp_path / "x")]))
        assert not (tmp_path / "x").exists()   # refused before anything is written


def test_grpo_group_prompts_are_prefilled_once(tiny_tok):
    """A training rollout's group shares one prompt per task: its first forward computes each
    prompt once (prefill_reused_tokens counts the copies); the episodes equal a no-dedupe run's."""
    from fastrehearse.envs.builtin import BuiltinSuite
    from fastrehearse.rollout import RolloutConfig, RolloutEngine

    model, tok = tiny_tok
    suite = BuiltinSuite()
    tasks = suite.tasks("train", 2)
    eps = {}
    for dedupe in (True, False):
        eng = RolloutEngine(model, tok, RolloutConfig(mode="rehearse", temperature=1.0, max_new_tokens=12,
                                                      max_turns=2))
        eng.backend_factory = lambda d=dedupe, e=eng: HFGenerator(model, pad_id=e.pad_id, dedupe=d)
        res = eng.rollout(tasks, suite, group_size=3, seed=5)
        eps[dedupe] = res
    first = [len(eng.prompt_for(t, suite.make_env(), 0).input_ids) for t in tasks]
    assert eps[True].metrics["prefill_reused_tokens"] == sum(2 * n for n in first)
    assert eps[False].metrics["prefill_reused_tokens"] == 0
    assert [e.input_ids for e in eps[True].episodes] == [e.input_ids for e in eps[False].episodes]


def test_bench_rehearsal_cache_refuses_bad_arguments():
    """The side-by-side benchmark checks its arguments before loading a model or a benchmark."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_rehearsal_cache.py"
    for argv, msg in ((["--variants", "fast"], "--variants: unknown ['fast']"),
                      (["--rounds", "0"], "--rounds must be >= 1")):
        r = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr, r.stderr[-500:]
        assert "Traceback" not in r.stderr
