"""DCP checkpoints (single process): round trip, crash-safety of partial writes, rotation, and the
numerics record that says when a resume can repeat a run bit for bit.

Bit-exact promises here hold in one process on one machine: the same torch, instruction set
(ATEN_CPU_CAPABILITY), thread count and device, so every fp32 sum runs in the same order."""
import json
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastrehearse.train.checkpoint import Checkpointer, numerics, numerics_note
from fastrehearse.train.parallelize import DistInfo

INFO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def _step(model, opt):
    ids = torch.randint(0, 64, (1, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_round_trip_restores_model_optimizer_rng_and_state(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    ck = Checkpointer(tmp_path, INFO, keep=2)
    torch.manual_seed(123)
    random.seed(7)
    path = ck.save(1, model, opt, {"step": 1, "cursor": 17})
    want_rand = (torch.rand(3), random.random())
    want_params = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt)                     # continue "the uninterrupted run"
    want_next = {k: v.clone() for k, v in model.state_dict().items()}

    model2 = _model(seed=99)              # a fresh process: different init
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    assert ck.latest() == path
    state = ck.load(path, model2, opt2)
    assert state == {"step": 1, "cursor": 17}
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want_params[k]), k
    got_rand = (torch.rand(3), random.random())
    assert torch.equal(got_rand[0], want_rand[0]) and got_rand[1] == want_rand[1]
    _step(model2, opt2)                   # same data (RNG restored) -> bitwise the same next step
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want_next[k]), k


def test_partial_checkpoint_is_never_picked_and_rotation(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(tmp_path, INFO, keep=2)
    for s in (1, 2, 3):
        ck.save(s, model, opt, {"step": s})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000002", "step_00000003"]          # keep=2
    # A run killed mid-write leaves a .tmp dir, and a dir without COMPLETE is not trusted either.
    (tmp_path / "checkpoints" / "step_00000009.tmp").mkdir()
    (tmp_path / "checkpoints" / "step_00000008").mkdir()
    assert ck.latest().name == "step_00000003"
    assert ck.resolve_resume().name == "step_00000003"
    ck.save(9, model, opt, {"step": 9})                         # replaces the stale .tmp
    assert ck.latest().name == "step_00000009"
    assert not (tmp_path / "checkpoints" / "step_00000009.tmp").exists()


def test_checkpoint_records_numerics_and_resume_names_a_change(tmp_path, monkeypatch):
    """COMPLETE records what fixes the summation order; a resume under another instruction set
    or thread count gets one line saying the continuation is correct but not bit-identical."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = Checkpointer(tmp_path, INFO, keep=2)
    path = ck.save(1, model, opt, {"step": 1})
    rec = json.loads((path / "COMPLETE").read_text())["numerics"]
    assert rec == numerics(INFO)
    assert rec["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert rec["threads"] == torch.get_num_threads() and rec["world_size"] == 1
    assert ck.numerics_note(path) is None                   # same process: nothing to say
    other = "AVX2" if rec["cpu_capability"] != "AVX2" else "DEFAULT"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    note = ck.numerics_note(path)
    assert note and f"cpu_capability {rec['cpu_capability']!r} -> {other!r}" in note
    assert "bit for bit" in note and "\n" not in note
    assert numerics_note(None, numerics(INFO)) is None      # a checkpoint from before the record
    old = dict(rec, threads=rec["threads"] + 1)
    assert "threads" in numerics_note(old, rec)
