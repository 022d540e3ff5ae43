"""The dry run says where each number comes from: every term labelled measured / formula / assumed
(table and JSON), the usable HBM as the default budget, the KV cache's torch.cat growth, the prefill
working set from one layer's no-grad peak (not its saved-for-backward set), the rollback copy in the
update's optimizer step with its cost, and a step time labelled predicted with a range."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from fastrehearse.cli import main
from fastrehearse.train import step_time
from fastrehearse.train.config import load_config
from fastrehearse.train.dry_run import (BASES, DEFAULT_BUDGET_GIB, GIB, KV_GROWTH_FACTOR, layer_activation_bytes,
                                        layer_prefill_bytes, plan, resolve_architecture)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@pytest.fixture(scope="module")
def multi_turn(tmp_path_factory):
    d = tmp_path_factory.mktemp("dry")
    out = d / "plan.json"
    import io
    from contextlib import redirect_stdout
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["train", "--config", str(CONFIGS / "qwen3_8b_bfcl_multi_turn.yaml"), "--set",
                   f"run_dir={d / 'rd'}", "--dry-run", "--world-size", "16", "--dry-run-json", str(out)])
    assert rc == 0
    return buf.getvalue(), json.loads(out.read_text())


def test_every_term_is_labelled_in_table_and_json(multi_turn):
    text, p = multi_turn
    assert p["is_a"].startswith("plan") and "PLAN" in text and "basis" in text
    basis = {i["name"]: i["basis"] for i in p["items"]}
    assert set(basis.values()) <= set(BASES) and len(basis) == len(p["items"])
    assert basis["policy shards (fp32 master)"] == "measured"
    assert basis["activations, 32768 tokens (checkpointing on)"] == "measured"
    assert basis["prefill working set, one layer (no grad)"] == "measured"
    assert basis["gradient shards (fp32)"] == "formula" and basis["CUDA context + NCCL"] == "assumed"
    for word in ("measured", "formula", "assumed"):
        assert word in text


def test_default_budget_is_the_usable_hbm(multi_turn, tmp_path, capsys):
    text, p = multi_turn
    assert p["gpu_memory_gib"] == DEFAULT_BUDGET_GIB == 79.19 and p["budget_basis"] == "assumed"
    assert "79.19 GiB" in text and "usable HBM" in text
    rc = main(["train", "--config", str(CONFIGS / "qwen3_8b_bfcl_multi_turn.yaml"), "--set",
               f"run_dir={tmp_path / 'rd'}", "--dry-run", "--world-size", "16", "--gpu-memory-gib", "139.8",
               "--dry-run-json", str(tmp_path / "p.json")])
    q = json.loads((tmp_path / "p.json").read_text())
    assert rc == 0 and q["gpu_memory_gib"] == 139.8 and q["budget_basis"] == "given"
    assert "(--gpu-memory-gib)" in capsys.readouterr().out


def test_kv_growth_and_prefill_from_the_no_grad_peak(multi_turn):
    _, p = multi_turn
    items = {i["name"]: i["bytes"] for i in p["items"]}
    kv = items["KV cache, every row at max_episode_tokens"]
    assert items["KV cache growth by torch.cat (allocator holes)"] == int((KV_GROWTH_FACTOR - 1) * kv)
    cfg = load_config(CONFIGS / "qwen3_8b_bfcl_multi_turn.yaml")
    hf_config, _ = resolve_architecture(cfg, None)
    working = layer_prefill_bytes(hf_config)
    full, _ = layer_activation_bytes(hf_config)
    assert hf_config.hidden_size * 2 < working < 0.6 * full      # the saved set over-counted a prefill
    distinct = min(64 // 16, cfg.rollout.engine.max_batch_size)
    assert items["prefill working set, one layer (no grad)"] == int(working * distinct * cfg.rollout.engine.max_episode_tokens)


def test_rollback_copy_lives_in_the_optimizer_step_and_its_cost_is_printed(multi_turn):
    text, p = multi_turn
    rb = next(i for i in p["items"] if i["name"].startswith("rollback copy"))
    assert rb["phase"] == "update" and rb["moment"] == "optimizer step"
    assert rb["bytes"] / GIB == pytest.approx(5.72, abs=0.01)          # 8.19B / 16 ranks x 12 bytes
    assert p["rollback_nonfinite"]["copy_gib"] == pytest.approx(rb["bytes"] / GIB)
    assert "optim.rollback_nonfinite costs 5.72 GiB per rank in the optimizer step" in " ".join(text.split())
    cfg = load_config(CONFIGS / "smoke.yaml", ["rollout.tasks_per_step=4"])
    cfg.optim.rollback_nonfinite = False
    off = plan(cfg, 4)
    cfg.optim.rollback_nonfinite = True
    on = plan(cfg, 4)
    assert on.total("resident") == off.total("resident")
    assert on.moment_total("optimizer step") - off.moment_total("optimizer step") == \
        next(i.bytes for i in on.items if i.name.startswith("rollback copy"))


def test_step_time_is_predicted_with_a_range(multi_turn):
    text, p = multi_turn
    st = p["step_time"]
    assert st["is_a"].startswith("predicted") and "PREDICTED step time" in text
    for lo, mid, hi in [*st["parts_s"].values(), st["total_s"]]:
        assert 0 < lo <= mid <= hi
    assert set(st["parts_s"]) == {"rollout (vLLM)", "weight sync", "update"}
    assert "hf backend" in " ".join(text.split())          # the preset rolls out with HF: said so


def test_step_time_device_basis_is_roofline_s(monkeypatch):
    spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
    roofline = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "roofline", roofline)     # its dataclasses look themselves up
    spec.loader.exec_module(roofline)
    assert (step_time.H100_TFLOPS, step_time.H100_TBPS) == (roofline.DEVICES["h100"]["tflops"],
                                                            roofline.DEVICES["h100"]["tbps"])


def test_step_time_collectives_within_one_node_are_faster():
    """The weight sync's all-gather: NVLink within one node of 8, the network across nodes."""
    cfg = load_config(CONFIGS / "qwen3_8b_bfcl_multi_turn.yaml")
    hf_config, _ = resolve_architecture(cfg, None)
    n = 8_190_735_360
    one, two = (step_time.predict_step_time(cfg, hf_config, w, n)["parts_s"]["weight sync"] for w in (8, 16))
    assert all(a < b for a, b in zip(one, two))
