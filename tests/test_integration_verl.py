"""verl adapter against verl 0.9.1's own torch reference (real verl, installed --no-deps, CPU).

verl/__init__ (and verl/utils/__init__) import ray / omegaconf, which a --no-deps install lacks:
the two packages are registered as bare namespace modules so only the submodules under test run.
"""
import importlib.util
import os
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def _import_verl():
    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl not installed")
    root = list(spec.submodule_search_locations)[0]
    for name, path in (("verl", root), ("verl.utils", os.path.join(root, "utils"))):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [path]
            sys.modules[name] = m
    from verl.utils.experimental.torch_functional import FusedLinearForPPO
    import verl.utils.kernel.linear_cross_entropy as lce
    return FusedLinearForPPO, lce


FusedLinearForPPO, verl_lce = _import_verl()

from fastrehearse.integrations import verl as fr_verl  # noqa: E402


def _inputs(shape, h, v, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*shape, h, generator=g) * scale).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, v, shape, generator=g)
    return hidden, weight, labels


def _verl_reference(hidden, weight, labels, temperature):
    # verl's own torch implementation (what its engine uses with impl_backend="torch")
    return FusedLinearForPPO(chunk_size=7, impl_backend="torch")(
        hidden, weight, labels, temperature=temperature)


@pytest.mark.parametrize("shape,h,v,temperature,scale", [
    ((3, 11), 24, 97, 1.0, 1.0),
    ((37,), 40, 301, 0.7, 3.0),        # flat input, large logits
    ((2, 5), 16, 64, 1.3, -2.0),
])
def test_matches_verl_torch_reference(shape, h, v, temperature, scale):
    hidden, weight, labels = _inputs(shape, h, v, seed=len(shape) + v, scale=scale)
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    lp_ref, ent_ref = _verl_reference(hidden, weight, labels, temperature)
    lp, ent = fr_verl.linear_cross_entropy(h2, w2, labels, temperature, "none")
    n = labels.numel()
    assert lp.shape == (n,) and ent.shape == (n,)          # verl's flat [B*T] contract
    assert lp.dtype == ent.dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    c1, c2 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    ((lp_ref.reshape(-1) * c1).sum() + (ent_ref.reshape(-1) * c2).sum()).backward()
    ((lp * c1).sum() + (ent * c2).sum()).backward()
    assert h2.grad.shape == hidden.shape
    # float64 truth: ours must be close to it; against verl's fp32 reference, allow that
    # reference's own rounding (its entropy is logsumexp - sum p z: ~|z| eps cancellation)
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    z = h64.reshape(n, h) @ w64.t() / temperature
    lp64 = torch.log_softmax(z, -1).gather(-1, labels.reshape(n, 1)).squeeze(1)
    ent64 = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    ((lp64 * c1.double()).sum() + (ent64 * c2.double()).sum()).backward()
    for name, ours, ref, truth, tol in (
            ("logp", lp, lp_ref, lp64, 1e-5), ("entropy", ent, ent_ref, ent64, 1e-5),
            ("d hidden", h2.grad, hidden.grad, h64.grad, 1e-4),
            ("d weight", w2.grad, weight.grad, w64.grad, 1e-4)):
        ours, ref, truth = ours.reshape(-1), ref.reshape(-1), truth.reshape(-1).detach()
        scale = 1.0 + float(truth.abs().max())
        torch.testing.assert_close(ours.double(), truth, rtol=0, atol=tol * scale,
                                   msg=lambda m: f"{name} vs float64: {m}")
        ref_err = float((ref.double() - truth).abs().max())
        torch.testing.assert_close(ours, ref, rtol=0, atol=tol * scale + ref_err,
                                   msg=lambda m: f"{name} vs verl: {m}")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reductions(reduction):
    hidden, weight, labels = _inputs((4, 6), 16, 50)
    lp_all, ent_all = fr_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "none")
    lp, ent = fr_verl.linear_cross_entropy(hidden, weight, labels, 1.0, reduction)
    assert lp.dim() == 0 and ent.shape == (24,)
    want = lp_all.sum() if reduction == "sum" else lp_all.mean()
    torch.testing.assert_close(lp, want)


def test_contract_errors():
    hidden, weight, labels = _inputs((2, 3), 8, 10)
    with pytest.raises(TypeError, match="float"):
        fr_verl.linear_cross_entropy(hidden, weight, labels, 1, "none")
    with pytest.raises(ValueError, match="reduction"):
        fr_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "max")
    with pytest.raises(NotImplementedError, match="dist_process_group"):
        fr_verl.linear_cross_entropy(hidden, weight, labels, 1.0, "none", object())
    bad = labels.clone()
    bad[1, 2] = 10
    with pytest.raises(ValueError):
        fr_verl.linear_cross_entropy(hidden, weight, bad, 1.0, "none")


def test_patch_verl_routes_verl_model_forward():
    """verl's own fused model forward (triton backend entry point) runs on fastrehearse after
    patch_verl(), on CPU, and agrees with verl's torch-backend forward."""
    transformers = pytest.importorskip("transformers")
    from verl.models.transformers import dense_common
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).float()
    ids = torch.randint(0, 90, (2, 9))
    patched = fr_verl.patch_verl()
    assert "verl.utils.kernel.linear_cross_entropy" in patched
    assert verl_lce.linear_cross_entropy is fr_verl.linear_cross_entropy
    assert fr_verl.patch_verl() == patched                       # idempotent
    tri = dense_common.forward_with_triton_backend(model, input_ids=ids, temperature=0.8,
                                                    return_dict=True)
    ref = dense_common.forward_with_torch_backend(model, input_ids=ids, temperature=0.8,
                                                  return_dict=True)
    assert tri.log_probs.shape == (18,) and ref.log_probs.shape == (2, 9)
    torch.testing.assert_close(tri.log_probs, ref.log_probs.reshape(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri.entropy, ref.entropy.reshape(-1), rtol=1e-5, atol=1e-5)


def test_patch_verl_backend():
    """patch_verl(backend=...) sets the kernels' backend of every routed call: 'triton-fused'
    (the Triton interpreter here) gives verl's torch-backend numbers; a bad name is refused."""
    hidden, weight, labels = _inputs((3, 7), 24, 97, seed=3)
    lp_ref, ent_ref = _verl_reference(hidden, weight, labels, 0.9)
    try:
        fr_verl.patch_verl(backend="triton-fused")
        with torch.no_grad():
            lp, ent = fr_verl.linear_cross_entropy(hidden, weight, labels, 0.9, "none")
        torch.testing.assert_close(lp, lp_ref.reshape(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ent_ref.reshape(-1), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="backend must be one of"):
            fr_verl.patch_verl(backend="cuda")
        assert fr_verl._STATE["backend"] == "triton-fused"          # a refused call changes nothing
    finally:
        fr_verl.patch_verl()
    assert fr_verl._STATE["backend"] == "auto"
