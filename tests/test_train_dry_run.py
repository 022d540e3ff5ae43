"""`fastrehearse train --dry-run --world-size N`: the run built and sharded on torch's fake
process group, a per-rank memory plan, exit 2 with one line when it does not fit; nothing written."""
import json
import math
from pathlib import Path

import pytest

from fastrehearse.cli import main
from fastrehearse.train.config import load_config
from fastrehearse.train.dry_run import GIB, layer_activation_bytes, plan, resolve_architecture

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# Every GPU preset at the world size its comment names (one or two nodes of 8 GPUs).
PRESETS = [("qwen3_1p7b_builtin.yaml", 8), ("qwen3_8b_bfcl.yaml", 16), ("qwen3_8b_bfcl_multi_turn.yaml", 16),
           ("qwen3_8b_tau2_telecom.yaml", 16)]


@pytest.mark.parametrize("name,world", PRESETS)
def test_presets_fit_80gib_at_their_world_size(name, world, tmp_path, capsys):
    assert f"{world // 8} node" in (CONFIGS / name).read_text().split("\n", 3)[1] + (CONFIGS / name).read_text()
    out = tmp_path / "plan.json"
    rd = tmp_path / "run_dir"
    rc = main(["train", "--config", str(CONFIGS / name), "--set", f"run_dir={rd}", "--dry-run",
               "--world-size", str(world), "--dry-run-json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "fits" in text and "per rank" in text
    p = json.loads(out.read_text())
    assert p["fits"] and p["world_size"] == world and 20 < p["peak_gib"] <= 80
    assert not rd.exists()                               # nothing written to run_dir


def test_one_rank_is_refused_with_one_line(tmp_path, capsys):
    rc = main(["train", "--config", str(CONFIGS / "qwen3_8b_bfcl_multi_turn.yaml"), "--dry-run", "--world-size", "1",
               "--set", f"run_dir={tmp_path / 'rd'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "does not fit 79.19 GiB per GPU at world size 1" in err[0] and "largest:" in err[0]
    assert not (tmp_path / "rd").exists()


@pytest.mark.parametrize("argv,msg", [
    (["--dry-run", "--world-size", "3"], "--world-size 3 does not divide dimension 0 (151936) of "
                                         "'model.model.embed_tokens.weight'"),
    (["--dry-run", "--world-size", "128"], "rollout.tasks_per_step=64 < --world-size 128"),
    (["--dry-run"], "--dry-run needs --world-size"),
    (["--world-size", "16"], "--world-size only goes with --dry-run"),
    (["--dry-run", "--world-size", "16", "--gpu-memory-gib", "0"], "--gpu-memory-gib must be > 0"),
    (["--dry-run", "--world-size", "16", "--arch", "/nonexistent"], "--arch '/nonexistent' is neither"),
])
def test_bad_input_one_line_exit_2(argv, msg, tmp_path, capsys):
    rc = main(["train", "--config", str(CONFIGS / "qwen3_8b_bfcl_multi_turn.yaml"),
               "--set", f"run_dir={tmp_path / 'rd'}", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0], err
    assert not (tmp_path / "rd").exists()


def test_plan_counts_what_fsdp2_shards_and_measures_activations():
    """Tiny model at 4 ranks: the resident shards are 1/4 of the padded parameters (x 4 bytes); the
    activation probe saves less with checkpointing; AC on/off changes the update phase only."""
    cfg = load_config(CONFIGS / "smoke.yaml", ["max_tokens=2048", "rollout.tasks_per_step=4"])
    hf_config, _ = resolve_architecture(cfg, None)
    p = plan(cfg, 4, 80)
    shards = next(i for i in p.items if i.name.startswith("policy shards"))
    assert shards.bytes == 4 * sum(math.ceil(n / 4) * r for n, r in _dims(hf_config))
    full, ckpt = layer_activation_bytes(hf_config)
    assert 0 < ckpt < full and ckpt == hf_config.hidden_size * 2        # a checkpointed layer keeps its bf16 input
    cfg.model.activation_checkpointing = True
    q = plan(cfg, 4, 80)
    assert q.total("resident") == p.total("resident") and q.total("update") < p.total("update")
    assert p.activations["with_checkpointing_gib"] < p.activations["without_checkpointing_gib"]
    assert p.peak_bytes == p.total("resident") + max(p.total("rollout"), p.total("update")) < 80 * GIB


def _dims(c):
    """(dim 0, elements per row) of every parameter of a tiny Llama (tied embeddings: once)."""
    h, i, v, kv = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h, 1), (h, 1)]
    return [(v, h)] + layer * c.num_hidden_layers + [(h, 1)]


def test_vllm_backend_is_planned_at_its_memory_share():
    cfg = load_config(CONFIGS / "smoke.yaml", ["rollout.tasks_per_step=4", "rollout.backend=vllm",
                                               "algo.tis_cap=null", "rollout.vllm.gpu_memory_utilization=0.3"])
    p = plan(cfg, 4, 80)
    names = {i.name: i for i in p.items}
    vllm = names["vLLM (weights + KV cache)"]
    assert vllm.bytes == int(0.3 * 80 * GIB) and vllm.phase == "rollout"    # slept through the update
    # no generation copy on the trainer's side: the sync streams one parameter at a time
    assert not any("generation copy" in n for n in names)
    hf_config, _ = resolve_architecture(cfg, None)
    serving = 4 if cfg.model.precision == "fp32" else 2    # bf16 on the GPU the plan is for
    assert names["weight sync: one gathered parameter"].bytes == max(n * r for n, r in _dims(hf_config)) * serving
    assert not any("KV cache, every row" in n for n in names)
