"""benchmarks/roofline.py: the model's parts (FLOP / byte bookkeeping, the three scenarios' rules,
the passes the code runs), the record schema and the peers' published numbers. Headline
predictions are not pinned: they follow from the parts."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "roofline.py"
_spec = importlib.util.spec_from_file_location("fr_roofline", _PATH)
roofline = importlib.util.module_from_spec(_spec)
sys.modules["fr_roofline"] = roofline      # dataclasses look their module up
_spec.loader.exec_module(roofline)

KEYS = {"method", "N", "H", "V", "unmasked", "predicted_ms", "predicted_ms_range", "floor_ms",
        "workspace_bytes", "bound_by", "status", "current", "measured"}
N, H, V = 16384, 4096, 128256
DEV = roofline.DEVICES["h200"]
OPT, CEN, PES = roofline.SCENARIOS
BW = 4.3e12


def _find(recs, method, key="reference", frac=1.0):
    out = [r for r in recs if r["method"] == method and r["design_key"] == key
           and r["unmasked"] == frac]
    assert len(out) == 1, (method, key, len(out))
    return out[0]


def _pieces(rec, prefix):
    return [p for p in rec["pieces"] if p["name"].startswith(prefix)]


@pytest.fixture(scope="module")
def recs():
    return roofline.build("h200", [(H, V)], [N], [1.0, 0.25])


def test_schema_ranges_and_one_current_design(recs):
    for r in recs:
        assert KEYS <= set(r), KEYS - set(r)
        lo, hi = r["predicted_ms_range"]
        assert lo <= r["predicted_ms"] <= hi and r["floor_ms"] > 0
        assert lo >= r["floor_ms"] * (1 - 1e-9)      # no scenario beats the design's own FLOPs
        assert r["measured"] is False and r["kind"] == "prediction"
        assert r["current"] == (r["status"] == "current")
    assert {r["method"] for r in recs} == set(roofline.METHODS)
    for m in ("ours-logprobs", "ours-fused-loss"):
        for f in (1.0, 0.25):
            cur = [r["design_key"] for r in recs if r["method"] == m and r["unmasked"] == f
                   and r["current"]]
            assert cur == {"ours-logprobs": ["vocab-outer"], "ours-fused-loss": ["budgeted"]}[m]
    keys = {r["design_key"] for r in recs if r["method"] == "ours-fused-loss"}
    assert keys == set(roofline.FUSED_DESIGNS)


def test_optimistic_is_the_plain_roofline_and_scenarios_are_ordered():
    """optimistic = max(FLOPs / rate, bytes / bandwidth) per piece (the audited best case)."""
    for p in (roofline.gemm("g", 1408, V, H, out_bytes=4), roofline.gemm("d", V, H, 1408,
              out_bytes=4, accumulate=True), roofline.passes("p", 1e9, 3, 2)):
        assert p.ms(DEV, OPT) == pytest.approx(
            p.count * (max(p.flops / 790e12, p.bytes / BW) + p.launches * 5e-6) * 1e3)
        assert p.ms(DEV, OPT) <= p.ms(DEV, CEN) <= p.ms(DEV, PES)
    assert [a.name for a in roofline.SCENARIOS] == ["optimistic", "central", "pessimistic"]


def test_gemm_tiles_waves_and_split_k():
    # pessimistic (no split-K): [1408, 4096] output = 11 x 16 = 176 tiles of 128x256 on 132 SMs
    # -> 2 waves; each tile K + 192 deep at 88% of the rate
    g = roofline.gemm("dX", 1408, H, V)
    tile = 2 * 128 * 256 / (0.88 * 790e12 / 132)
    t = 2 * tile * (V + 192) + 0.5 * 1408 * H * 2 / (BW * 0.7)    # + half the output exposed
    assert g.ms(DEV, PES) == pytest.approx(t * 1e3)
    # central: split-K 8 gives 1408 tiles = 11 waves of K/8 + 64, plus the fp32 partials
    bw = BW * 0.85
    tile_c = 2 * 128 * 256 / (0.97 * 790e12 / 132)
    cands = []
    for s in (1, 2, 4, 8):
        c = math.ceil(s * 176 / 132) * tile_c * (V / s + 64)
        cands.append(c + (2 * s * 1408 * H * 4 / bw if s > 1 else 0))
    assert min(cands) == cands[3]
    assert g.ms(DEV, CEN) == pytest.approx((cands[3] + 0.25 * 1408 * H * 2 / bw) * 1e3)
    # a small-M chunk costs whole 128-row tiles: 100 rows take as long as 128
    a, b = roofline.gemm("", 100, V, H), roofline.gemm("", 128, V, H)
    assert a.ms(DEV, PES) == pytest.approx(b.ms(DEV, PES), rel=0.02)
    assert a.flops / b.flops == pytest.approx(100 / 128)


def test_accumulator_exposure():
    """An accumulating GEMM's output (read + written) is exposed by acc_exposed: central half,
    pessimistic all of it; a compute-bound accumulator costs nothing extra optimistically."""
    acc = roofline.gemm("dW +=", V, H, 1408, out_bytes=4, accumulate=True)
    assert acc.out_bytes == 2 * V * H * 4
    plain = roofline.gemm("dW =", V, H, 1408, out_bytes=4)
    assert acc.ms(DEV, OPT) == pytest.approx(acc.flops / 790e12 * 1e3)
    for a, f in ((CEN, 0.5), (PES, 1.0)):
        bw = BW * a.bw_eff
        diff = acc.ms(DEV, a) - plain.ms(DEV, a)
        assert diff == pytest.approx((f * 2 * V * H * 4 - a.out_exposed * V * H * 4) / bw * 1e3)


def test_hand_computed_flops_and_bytes(recs):
    nhv = N * H * V
    fused = _find(recs, "ours-fused-loss", "row-chunked")
    assert fused["flops"] == 6 * nhv                   # fwd GEMM + dX + dW, 512-row chunks
    assert fused["floor_ms"] == pytest.approx(6 * nhv / 790e12 * 1e3, rel=1e-4)   # 65.37 ms
    assert _find(recs, "ours-logprobs", "row-chunked")["flops"] == 8 * nhv   # + the recompute
    assert _find(recs, "ours-logprobs", "vocab-outer")["flops"] == pytest.approx(8 * nhv)
    assert _find(recs, "naive")["flops"] == 6 * nhv
    # the fp32 dW accumulator per 512-row chunk: read dZ^T (bf16), X_c (bf16), read and write
    # the V x H fp32 accumulator; 32 chunks (~134 GB of accumulator traffic)
    (dw,) = _pieces(fused, "dW += ")
    assert dw["count"] == 32 and dw["flops"] == 2 * 512 * V * H
    assert dw["bytes"] == 512 * V * 2 + 512 * H * 2 + 2 * V * H * 4
    # the current code: chunks from _fused_linear_loss.fused_loss_rows' default 3 GiB budget,
    # which counts the fp32 V x H accumulator: 11 chunks of 1408 rows and a last one of 896
    cur = _find(recs, "ours-fused-loss", "budgeted")
    assert cur["flops"] == pytest.approx(6 * nhv, rel=1e-12)
    assert cur["workspace_bytes"] == V * H * 4 + 1408 * V * (4 + 2) <= 3 * 2**30
    full, last = _pieces(cur, "dW += ")
    assert (full["count"], last["count"]) == (11, 1) and "[last, 896 rows]" in last["name"]
    assert full["bytes"] == 1408 * (V + H) * 2 + 2 * V * H * 4
    # at 25% unmasked, compacting designs do a quarter of the FLOPs, the reference all of them
    assert _find(recs, "ours-fused-loss", "row-chunked", 0.25)["flops"] == 6 * nhv // 4
    assert _find(recs, "naive", frac=0.25)["flops"] == 6 * nhv


def test_every_pass_the_code_runs(recs):
    """Besides GEMMs and row kernels: the backward's mul_ of dX and dW by grad_out (fused loss),
    index_select and its backward (the fused loss always, linear_logprobs only when masked), the
    accumulator's zero-fill + final cast, the per-token small ops."""
    cur = _find(recs, "ours-fused-loss", "budgeted")
    (mul,) = _pieces(cur, "backward: dX.mul_")
    assert mul["bytes"] == (N * H + V * H) * 2 * 2
    for rec, n in ((cur, N), (_find(recs, "ours-fused-loss", "budgeted", 0.25), N // 4)):
        (sel,) = _pieces(rec, "index_select of the loss rows")
        (back,) = _pieces(rec, "index_select backward")
        assert sel["bytes"] == n * H * 2 * 2
        assert back["bytes"] == N * H * 2 + n * H * 2 * 3
    (zc,) = _pieces(cur, "dW: zero fp32 accumulator + final cast")
    assert zc["bytes"] == V * H * (4 + 4 + 2)
    assert sum(p["count"] * p["launches"] for p in cur["pieces"]) >= 12 * roofline.FUSED_LOSS_OPS
    lp = _find(recs, "ours-logprobs", "vocab-outer")
    assert not _pieces(lp, "index_select")            # all rows: compact_rows returns None
    assert _pieces(_find(recs, "ours-logprobs", "vocab-outer", 0.25), "index_select backward")
    # bf16 dW accumulation: the returned dW is the accumulator (zeroed, no cast)
    (zb,) = _pieces(_find(recs, "ours-fused-loss", "budgeted-bf16"), "dW: zero the bf16")
    assert zb["bytes"] == V * H * 2


def test_fused_forward_and_epilogue_designs(recs):
    """triton-fused: the forward tile GEMM writes 3 fp32 partials per row and 128-column tile
    instead of fp32 logits; the backward is vocab-outer's. fused-epilogue: 2-byte logits plus
    2 fp32 partials per 256-column tile, no row-stats pass, 4 chunks of 4096 rows."""
    ff = _find(recs, "ours-logprobs", "fused-fwd")
    vo = _find(recs, "ours-logprobs", "vocab-outer")
    (fwd,) = _pieces(ff, "fwd fused tiles")
    assert fwd["flops"] == 2 * N * H * V
    assert fwd["bytes"] == pytest.approx(N * H * 2 + V * H * 2 + N * V * 12 / 128)
    assert not _pieces(ff, "fwd _row_stats_kernel")
    assert ff["flops"] == pytest.approx(vo["flops"])
    bwd = lambda r: [p for p in r["pieces"] if p["name"].startswith(("bwd", "_row_grad", "dX", "dW"))]  # noqa
    assert bwd(ff) == bwd(vo)
    ep = _find(recs, "ours-fused-loss", "fused-epilogue")
    assert ep["status"] == "hypothetical" and not ep["current"]
    (g,) = _pieces(ep, "fwd Z GEMM, epilogue")
    assert g["count"] == 4 and g["bytes"] == pytest.approx(
        4096 * H * 2 + V * H * 2 + 4096 * V * (2 + 8 / 256))
    assert not _pieces(ep, "fwd _row_stats_kernel")
    (rg,) = _pieces(ep, "_row_grad_kernel")
    assert rg["bytes"] == 4096 * V * (2 + 2)
    assert ep["workspace_bytes"] == V * H * 4 + 4096 * V * 2


def test_peers_are_their_published_measurements():
    peers = roofline.peer_records()
    assert all(p["measured"] is True and p["source"] and p["quote"] for p in peers)
    got = {p["method"]: (p["measured_ms"], p["memory_mb"], p["device"], p["N"], p["H"], p["V"])
           for p in peers}
    # the figures as their sources state them (checked against the files; see docs/gpu.md)
    assert got["Liger FLCE, CuTe-DSL SM90 kernel"] == (18.06, None, "NVIDIA H200", 4096, 4096, V)
    assert got["QuACK 0.6.1 chunked_linear_cross_entropy"][0] == 17.33
    assert got["Liger FLCE, Triton"][0] == 141.0
    assert got["Liger FLCE 0.4.2"] == (277.12, 4910.4, "NVIDIA A100-SXM4-80GB", 16384, 4096, V)
    assert got["HF (torch linear + cross_entropy), Liger's baseline"][:2] == (220.78, 15302.4)
    assert got["cut-cross-entropy (cce)"] == (134.8, 1164.0, "NVIDIA A100-SXM4-80GB", 8192, 2304,
                                              256000)
    assert got["torch.compile (CCE's baseline)"][:2] == (144.0, 16000.1)
    for p in peers:     # our ratio, on the stated basis
        rate = 790e12 if p["device"] == "NVIDIA H200" else 312e12
        assert p["ratio_to_6nhv"] == pytest.approx(
            p["measured_ms"] / (6 * p["N"] * p["H"] * p["V"] / rate * 1e3), abs=1e-3)


def test_targets_and_json(tmp_path, recs):
    t = roofline.targets(recs)
    assert {(x["method"], x["design_key"]) for x in t} == {
        ("ours-logprobs", k) for k in ("vocab-outer", "fused-fwd", "row-chunked")} | {
        ("ours-fused-loss", k) for k in roofline.FUSED_DESIGNS}
    for x in t:
        lo, hi = x["time_vs_target_floor_range"]
        assert lo <= x["time_vs_target_floor"] <= hi
        assert x["time_met"] == (x["time_vs_target_floor"] <= 1.10)
    fl = next(x for x in t if x["design_key"] == "budgeted")
    assert not fl["workspace_met"]      # the 1.96 GiB fp32 accumulator alone exceeds 1.5 GiB
    bf = next(x for x in t if x["design_key"] == "budgeted-bf16")
    assert bf["workspace_met"]

    out = tmp_path / "r.json"
    roofline.main(["--shapes", "576x49152", "--n", "4096", "--fracs", "1.0", "--json", str(out),
                   "--measured"])
    data = json.loads(out.read_text())
    assert data[0]["kind"] == "assumptions" and len(data[0]["scenarios"]) == 3
    preds = [r for r in data if r.get("kind") == "prediction"]
    peers = [r for r in data if r.get("measured")]
    assert preds and all(KEYS <= set(r) for r in preds)
    assert len(peers) == len(roofline.PEER_MEASUREMENTS)
    assert all(r["source"] and r["device"] and r["N"] for r in peers)


def test_measured_join(tmp_path):
    recs = roofline.build("h100", [(576, 49152)], [4096], [1.0])
    m = tmp_path / "bench.json"
    m.write_text(json.dumps({"hardware": {"gpu": "X"}, "gemm_tflops": 700.0, "rows": [
        {"method": "ours (triton)", "N": 4096, "H": 576, "V": 49152, "frac": 1.0,
         "median_ms": 3.0}]}))
    roofline.join_measured(recs, [str(m)])
    hit = [r for r in recs if r.get("measured_ms") == 3.0]
    assert {r["design_key"] for r in hit} == {"vocab-outer", "row-chunked"}
    assert all(isinstance(r["measured_within_range"], bool) for r in hit)
    assert all(r["device"] == "NVIDIA H100 SXM" and r["hbm_tbps"] == 3.0 for r in recs)


def test_fused_loss_ideas(recs):
    ideas = {r["idea"]: r for r in roofline.fused_loss_ideas("h200")}
    cur = ideas["(a) budget 3 GiB"]
    assert cur["predicted_ms"] == _find(recs, "ours-fused-loss", "budgeted")["predicted_ms"]
    # more budget -> fewer chunks -> faster, never below the floor
    for i in (0, 1):
        times = [ideas[f"(a) budget {b} GiB"]["ratio_to_6nhv_range"][i]
                 for b in ("2.5", "3", "4", "6")]
        assert times == sorted(times, reverse=True) and times[-1] > 1.0
    # (c) drops the zero-fill and one read of the accumulator: optimistically V x H x 8 bytes,
    # of which the read of zeros hides under the first GEMM's FLOPs
    first = ideas["(a) 3 GiB + (c) first chunk plain mm"]
    assert cur["predicted_ms_range"][0] - first["predicted_ms_range"][0] == pytest.approx(
        V * H * 4 / BW * 1e3, rel=0.05)
    for name, r in ideas.items():
        if name.startswith(("before", "(a)")):
            assert r["workspace_bytes"] > 1.5 * 2**30     # an fp32 V x H accumulator: 1.96 GiB
    assert [n for n, r in ideas.items() if r["verdict"].startswith("unsound")] == \
        ["(a) 3 GiB + (b) bf16 logits"]
