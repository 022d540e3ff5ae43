"""Every chunk and block size of the kernels comes from one planner (`_common.plan_chunk`), each
caller stating its budget and item size: the sizes chosen for a grid of shapes, dtypes, devices,
budgets and chunk_size overrides are pinned here, so a change to the planner or to a caller's
parameters that moves any of them fails. The device objects only name the device: no GPU needed."""
import pytest
import torch

from fastrehearse.kernels import _blocked, _common, _fused_linear_loss, _vocab_outer
from fastrehearse.kernels.linear_logprobs import forward_rows

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICES = {"cpu": torch.device("cpu"), "cuda": torch.device("cuda")}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(0, 8, 1), (1, 8, 10), (100, 16, 257), (1000, 576, 49152), (5000, 2048, 151936),
          (16380, 4096, 128256), (16384, 4096, 128256), (16384, 8192, 256000),
          (4096, 896, 1_000_000)]
HEAD = object()          # a head variant is present (its contents do not size anything)


def forward_sizes(n, v, dev):
    """linear_logprobs' forward (and the fused loss's forward-only 'triton-fused' sweep)."""
    out = [forward_rows(n, v, None, dev, "torch", None, cs) for cs in (None, 7)]
    out += [forward_rows(n, v, None, dev, "triton", None, cs) for cs in (None, 7)]
    out += [forward_rows(n, v, None, dev, "torch", HEAD, None)]
    out += [forward_rows(n, v, dt, dev, "triton-fused", None, None, budget)
            for budget in (None, 1 << 20) for dt in DTYPES]
    out += [forward_rows(n, v, torch.bfloat16, dev, "triton-fused", None, 7)]
    return tuple(out)


BLOCK_ROWS = (0, 8, 16, 100, 4096, 16384)
BLOCK_VOCABS = (10, 320, 333, 49152, 151936)


def block_sizes(r, dev):
    """The torch backend's vocabulary blocks (_blocked.py)."""
    return tuple(_blocked._block_cols(r, v, dev) for v in BLOCK_VOCABS)


def _or_refused(fn):
    try:
        return fn()
    except ValueError as e:
        assert "cannot hold the fused loss's" in str(e)
        return "refused"


def loss_sizes(n, h, v, dev):
    """The fused policy loss's sweep: per-row bytes x fixed bytes x budget, and an override."""
    acc = v * h * 4
    out = [_or_refused(lambda: _fused_linear_loss.fused_loss_rows(
        n, v, dev, elem_bytes=elem, fixed_bytes=fixed, workspace_bytes=ws))
        for elem in (4, 6, 10) for fixed in (0, acc)
        for ws in (None, acc + 17 * v * 4, 3 << 29, 3 << 30)]
    out.append(_fused_linear_loss.fused_loss_rows(n, v, dev, elem_bytes=6, fixed_bytes=acc,
                                                  chunk_size=7))
    return tuple(out)


def vocab_outer_sizes(n, h, v, dev):
    """The vocabulary-outer backward's (rows, columns)."""
    return tuple(_vocab_outer.vocab_outer_plan(n, h, v, dev, block_elem_bytes=elem,
                                               workspace_bytes=ws, rows=rows)
                 for elem in (4, 6, 10) for ws in (None, 40_000, n * h * 4 + 40_000, 256 << 20)
                 for rows in (None, 10, 1000))


# ---- today's planners (expected values) ----------------------------------------------------------


def old_forward_sizes(n, v, dev):
    c = _common
    out = [c.torch_block_rows(n, cs) for cs in (None, 7)]
    out += [c.chunk_rows(n, v, dev, cs) for cs in (None, 7)]
    out += [c.chunk_rows(n, v, dev, None)]
    out += [c.fused_rows(n, v, dt, dev, None, budget) for budget in (None, 1 << 20) for dt in DTYPES]
    out += [c.fused_rows(n, v, torch.bfloat16, dev, 7)]
    return tuple(out)


def old_block_sizes(r, dev):
    return tuple(_common.vocab_block(r, v, dev) for v in BLOCK_VOCABS)


def old_loss_sizes(n, h, v, dev):
    acc = v * h * 4
    out = [_or_refused(lambda: _common.fused_loss_rows(
        n, v, dev, elem_bytes=elem, fixed_bytes=fixed, workspace_bytes=ws))
        for elem in (4, 6, 10) for fixed in (0, acc)
        for ws in (None, acc + 17 * v * 4, 3 << 29, 3 << 30)]
    out.append(_common.fused_loss_rows(n, v, dev, elem_bytes=6, fixed_bytes=acc, chunk_size=7))
    return tuple(out)


def old_vocab_outer_sizes(n, h, v, dev):
    return tuple(_common.vocab_outer_plan(n, h, v, dev, block_elem_bytes=elem, workspace_bytes=ws,
                                          rows=rows)
                 for elem in (4, 6, 10) for ws in (None, 40_000, n * h * 4 + 40_000, 256 << 20)
                 for rows in (None, 10, 1000))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("n,h,v", SHAPES)
def test_forward_and_loss_sizes(n, h, v, dev):
    d = DEVICES[dev]
    assert forward_sizes(n, v, d) == old_forward_sizes(n, v, d)
    assert loss_sizes(n, h, v, d) == old_loss_sizes(n, h, v, d)
    assert vocab_outer_sizes(n, h, v, d) == old_vocab_outer_sizes(n, h, v, d)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("r", BLOCK_ROWS)
def test_block_sizes(r, dev):
    assert block_sizes(r, DEVICES[dev]) == old_block_sizes(r, DEVICES[dev])
