"""Sharded construction and loading: a sharded run builds the model on meta, shards it and
reads only its rows of each tensor from the safetensors files; the reference and the generation copy
come from the policy's shards. What it trains on must be exactly what from_pretrained loads --
tied embeddings one parameter, biases, norms, RoPE buffers -- at 1 rank (a group of one) and 2."""
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastrehearse.model.loader import build_tiny_model, load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _torchrun import torchrun  # noqa: E402


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_dir(request, tmp_path_factory):
    """A saved HF directory: tiny Llama (tied embeddings) or Qwen2 (untied head, q/k/v biases),
    hidden 64 x 3 layers: odd shapes that do not split evenly over 2 ranks (vocab 49152 does)."""
    d = tmp_path_factory.mktemp(request.param)
    tok = load_tokenizer("smollm2")
    m = build_tiny_model(request.param, vocab_size=len(tok), seed=3, hidden_size=64, num_layers=3,
                         num_heads=4, num_kv_heads=2, intermediate_size=96)
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return d, request.param


def _run(nproc, spec, ac, tmp_path) -> dict:
    out = tmp_path / f"load{nproc}{ac}.pt"
    p = torchrun(nproc, "_sharded_load_worker.py", out, spec, ac, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("nproc,ac", [(2, "false"), (1, "true")])
def test_sharded_load_equals_from_pretrained(hf_dir, nproc, ac, tmp_path):
    d, family = hf_dir
    want = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    want_sd = want.state_dict()
    res = _run(nproc, d, ac, tmp_path)
    assert res["world_size"] == nproc and res["sharded"]
    assert res["tied"] == (family == "llama")
    names = {n for n, _ in want.named_parameters()}      # a tied head is the embedding
    for part in ("policy", "ref", "gen"):
        got = res[part]
        assert names <= set(got), (part, names - set(got))
        for n in names:
            assert torch.equal(got[n].float(), want_sd[n]), (part, n)
    bufs = dict(want.named_buffers())
    rope = [k for k in res["gen"] if k.endswith("inv_freq")]
    assert rope and all(torch.equal(res["gen"][k], bufs[k]) for k in rope)   # buffers kept real
    assert res["ref_frozen"] and not res["gen_is_policy_model"]


def test_checkpoint_missing_a_tensor_is_named(hf_dir, tmp_path):
    """A safetensors file that lacks a parameter of config.json's architecture: one line naming it."""
    from safetensors.torch import load_file, save_file
    d, _ = hf_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in d.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(next(d.glob("*.safetensors"))))
    sd.pop("model.norm.weight")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    p = torchrun(1, "_sharded_load_worker.py", tmp_path / "x.pt", bad, "false", timeout=600)
    assert p.returncode != 0 and "'model.norm.weight' is not in the checkpoint" in p.stdout + p.stderr


def test_sharded_training_run_exports_and_resumes(tmp_path):
    """`torchrun --nproc_per_node=2 -m fastrehearse.train` end to end on the meta-built, sharded
    model: SFT + RL steps, checkpoints, an HF export that from_pretrained loads, then --resume."""
    rd = tmp_path / "run"
    sets = ["--set", f"run_dir={rd}", "--set", "eval.num_tasks=2", "--set", "log.progress=false",
            "--set", "sft.steps=1", "--set", "steps=2"]
    p = torchrun(2, "-m fastrehearse.train", "--config", "configs/smoke.yaml", *sets)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "world 2 (gloo" in p.stdout
    model = AutoModelForCausalLM.from_pretrained(rd / "export")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight   # still tied
    p = torchrun(2, "-m fastrehearse.train", "--config", "configs/smoke.yaml", *sets[:-2], "--set", "steps=3",
                 "--resume")
    assert p.returncode == 0 and "resumed from" in p.stdout and "(step 3)" in p.stdout, (p.stdout + p.stderr)[-3000:]
    assert (rd / "checkpoints" / "step_00000004").is_dir()
