"""TRL's fused-LM-head protocol served by fastrehearse's kernels (`patch_fused_lm_head`).

trl 1.16's trainers score tokens through `model(..., labels=labels, fused_lm_head=True)` ->
`.log_probs`, `.entropy` (`trl.trainer.utils.add_fused_lm_head`). `patch_fused_lm_head` replaces
that path by `linear_logprobs`: the shift by one position, -100 labels as a bool mask (masked rows
cost nothing), the head's bias / scale / soft-cap from the one head spec
(`fastrehearse.model.lm_head`), checked once against the model's own logits (`verify_head`),
autocast off around the head (hidden states cast to the head weight's dtype, as TRL's
`cast_lm_head_to_fp32` does for fp32 heads), and MoE models' router load-balancing loss returned
as `.aux_loss` when `output_router_logits` is asked for (as TRL's head does).
"""
from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass

import torch

from fastrehearse.dtensor import full_tensor
from fastrehearse.kernels import linear_logprobs

SUPPORTED_OUTPUTS = ("log_probs", "entropy")


class UnsupportedModelError(ValueError):
    """The model's LM head does something the kernels cannot express (never scored wrongly)."""


@dataclass(frozen=True)
class HeadTransform:
    """logits = softcap(logit_scale * (h @ W.T + bias)), softcap(z) = c tanh(z / c)."""
    has_bias: bool
    logit_softcap: float | None
    logit_scale: float | None


def _modules_to_save_wrapper():
    try:
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:  # peft is optional: without it no head can be such a wrapper
        return ()
    return ModulesToSaveWrapper


def resolve_head(model) -> torch.nn.Linear:
    """The nn.Linear the model's LM head runs right now.

    A PEFT `modules_to_save=["lm_head"]` wrapper runs its trainable copy, or the original head
    while adapters are disabled (TRL's reference pass); this mirrors its forward. A LoRA adapter
    on the head (or any other module) is refused by name.
    """
    head = model.get_output_embeddings()
    while isinstance(head, _modules_to_save_wrapper()):
        active = head.active_adapters
        if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
            head = head.original_module
        else:
            head = head.modules_to_save[active[0]]
    if type(head) is torch.nn.Linear:
        return head
    if hasattr(head, "base_layer") and hasattr(head, "lora_A"):
        raise UnsupportedModelError(
            f"{type(model).__name__}: the LM head carries a LoRA adapter ({type(head).__module__}."
            f"{type(head).__name__}); fastrehearse does not score LoRA-wrapped heads (TRL 1.16's "
            "GRPOTrainer refuses them too): leave 'lm_head' out of target_modules, or train the "
            "whole head with modules_to_save=['lm_head']")
    raise UnsupportedModelError(
        f"{type(model).__name__}: the LM head is a {type(head).__name__}, not a plain "
        "torch.nn.Linear; fastrehearse cannot score it")


def head_transform(model) -> HeadTransform:
    """The head transform of `model` from the one head spec (`fastrehearse.model.lm_head`, which
    the trainer reads too). Raises UnsupportedModelError for heads the kernels cannot run.
    Transforms no config field announces are caught by `verify_head`."""
    head = resolve_head(model)
    head_spec = _head_spec()
    try:
        kw = head_spec.head_settings(model)
    except head_spec.HeadSpecError as e:
        raise UnsupportedModelError(str(e)) from None
    return HeadTransform(head.bias is not None, kw.get("logit_softcap"), kw.get("logit_scale"))


def _head_spec():
    # fastrehearse.model imports transformers (it registers the varlen attention); this module
    # must import without it (the kernels-only install imports the integrations)
    from fastrehearse.model import lm_head
    return lm_head


def head_kwargs(tr: HeadTransform, head) -> dict:
    kw = {}
    if tr.has_bias:
        kw["bias"] = full_tensor(head.bias)
    if tr.logit_softcap is not None:
        kw["logit_softcap"] = tr.logit_softcap
    if tr.logit_scale is not None:
        kw["logit_scale"] = tr.logit_scale
    return kw


def head_inputs(hidden, head):
    """(hidden, weight) for the kernels: hidden in the weight's dtype, DTensors gathered."""
    weight = full_tensor(head.weight)
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return hidden.to(weight.device), weight


def backbone(model):
    # Looked up per call (FSDP / PEFT replace modules after patching), as TRL does.
    return model.base_model


# ---- the head check: the model's own logits, like with like ----------------------------------


def _unit_roundoff(t: torch.Tensor) -> float:
    return torch.finfo(t.dtype).eps / 2


def _gemm_roundoffs(z: torch.Tensor) -> tuple[float, float]:
    """(u_in, u_acc) of the GEMM that produced z: operands rounded to z's dtype (autocast casts
    both), accumulated in fp32 for half types unless the backend allows reduced-precision sums."""
    u = _unit_roundoff(z)
    u_in, u_acc = u, u
    if z.dtype in (torch.bfloat16, torch.float16):
        u_acc = 2.0**-24
        m = torch.backends.cuda.matmul
        if z.is_cuda and ((z.dtype == torch.float16 and m.allow_fp16_reduced_precision_reduction)
                          or (z.dtype == torch.bfloat16
                              and m.allow_bf16_reduced_precision_reduction)):
            u_acc = u
    elif z.dtype == torch.float32 and z.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        u_in = 2.0**-11                 # TF32 operands: 10 mantissa bits
    return u_in, u_acc


@torch.no_grad()
def verify_head(model, tr: HeadTransform, forward=None, seq_len: int = 8) -> None:
    """Check on a short random input that the model's own forward computes its logits as
    softcap(scale * (h W^T + b)) from its backbone's last hidden state h, judged in the precision
    it ran in (like with like): one forward through `forward` (default model.forward; TRL's
    reference model runs wrapped in bf16 autocast) with hooks on the backbone and the head, then
        1. the head's input is the backbone's output (times MiniCPM3's pre-head factor);
        2. the head's output z is h W^T + b within the rounding bound of a GEMM in z's dtype
           (operands and result rounded to it, sums in its accumulator);
        3. the logits are the transform of z within the rounding of its few elementwise ops in
           the dtype they ran in.
    Raises UnsupportedModelError naming the largest excess. Runs in eval mode (no dropout)."""
    forward = model.forward if forward is None else forward
    head = resolve_head(model)
    wrapper = model.get_output_embeddings()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.weight.shape[0], (1, seq_len), generator=g).to(head.weight.device)
    seen: dict[str, torch.Tensor] = {}

    def on_backbone(mod, args, out):
        seen["h"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def on_head(mod, args, out):
        seen["x"], seen["z"] = args[0], out

    hooks = [backbone(model).register_forward_hook(on_backbone),
             wrapper.register_forward_hook(on_head)]
    was_training = model.training
    model.eval()
    try:
        logits = forward(input_ids=ids, use_cache=False).logits
    finally:
        model.train(was_training)
        for hk in hooks:
            hk.remove()
    name = type(model).__name__
    if "h" not in seen or "z" not in seen:
        part = "its backbone (base_model)" if "h" not in seen else "its LM head"
        raise UnsupportedModelError(f"{name}: its forward does not run {part}; fastrehearse "
                                    "cannot score this model")
    h, x, z = seen["h"].double(), seen["x"], seen["z"]
    if logits.shape != z.shape or h.shape != x.shape:
        raise UnsupportedModelError(
            f"{name}: logits {tuple(logits.shape)} / head output {tuple(z.shape)} / hidden "
            f"{tuple(h.shape)} vs head input {tuple(x.shape)}: fastrehearse cannot score this model")
    # 1. the head sees the backbone's output (MiniCPM3: divided by logits_scaling first)
    pre = _head_spec().hidden_multiplier(model)
    want_x = h * pre
    _check(name, "its LM head's input is not its backbone's last hidden state",
           x.double(), want_x, (2 * _unit_roundoff(x) if pre != 1.0 else 0.0) * want_x.abs())
    # 2. the head is a GEMM (+ bias) in z's precision
    w = full_tensor(head.weight).double()
    b = None if head.bias is None else full_tensor(head.bias).double()
    x64 = x.double()
    ref_z = x64 @ w.t() + (0.0 if b is None else b)
    mag = x64.abs() @ w.abs().t() + (0.0 if b is None else b.abs())
    u_in, u_acc = _gemm_roundoffs(z)
    k = x.shape[-1]
    gamma = k * u_acc / (1 - k * u_acc)
    _check(name, "its LM head is not h W^T + b", z.double(), ref_z,
           (2 * u_in + gamma) * mag + _unit_roundoff(z) * ref_z.abs())
    # 3. the logits are the announced transform of z (a scale folded into MiniCPM3's hidden is not
    #    applied again)
    a = 1.0 if tr.logit_scale is None else tr.logit_scale / pre
    y = z.double() * a
    n_ops = int(a != 1.0)
    ref = y
    if tr.logit_softcap is not None:
        ref = tr.logit_softcap * torch.tanh(y / tr.logit_softcap)
        n_ops += 3
    u = max(_unit_roundoff(z), _unit_roundoff(logits))
    _check(name, f"its logits differ from softcap(scale * (h W^T + b)) with {tr}",
           logits.double(), ref, (2 * n_ops + 1) * u * (y.abs() + ref.abs()))


def _check(name, what, got, want, tol):
    excess = (got - want).abs() - tol
    worst = float(excess.max())
    if not worst <= 0.0:
        i = int(excess.flatten().argmax())
        err = float((got - want).abs().flatten()[i])
        raise UnsupportedModelError(
            f"{name}: {what}: they differ by {err:.3g} where the rounding of the precision it ran "
            f"in allows {float(tol.flatten()[i]) if torch.is_tensor(tol) else tol:.3g}; the head "
            "does something fastrehearse cannot express, refusing it")


# ---- MoE: the router's load-balancing loss, as the model's own forward computes it -----------


def router_aux_loss_fn(model):
    """(router_logits, attention_mask) -> the model's load-balancing loss, using the function and
    expert counts its own CausalLM forward uses; None when the model has no such function."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    cfg = model.config.get_text_config()
    n = getattr(model, "num_experts", None) or getattr(cfg, "num_local_experts", None) \
        or getattr(cfg, "num_experts", None)
    k = getattr(model, "num_experts_per_tok", None) or getattr(cfg, "num_experts_per_tok", None)
    if fn is None or n is None or k is None:
        return None
    return lambda router_logits, attention_mask: fn(router_logits, n, k, attention_mask)


def router_aux_loss(model, aux_fn, out, attention_mask):
    if aux_fn is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: output_router_logits was asked for, but fastrehearse finds no "
            "load_balancing_loss_func (with num_experts / num_experts_per_tok) for this model; "
            "set router_aux_loss_coef=0 in GRPOConfig")
    return aux_fn(out.router_logits, attention_mask)


# ---- the patch ----------------------------------------------------------------------------------


def patch_fused_lm_head(model, temperature: float = 1.0, outputs=("log_probs",),
                        verify: bool = True) -> HeadTransform:
    """Make `model(..., labels=labels, fused_lm_head=True)` return fastrehearse log-probs.

    The same contract as `trl.trainer.utils.add_fused_lm_head` (its outputs `log_probs` and
    `entropy` are supported; the others raise): per-token fields are [B, T-1] (or [B, T] with
    `shift_labels`), exactly 0 where the label is -100; with `output_router_logits` (MoE) the
    router loss comes back as `.aux_loss` (and `router_aux_loss_coef` times it is added to
    `.loss`). Any other call goes to the forward the model had before (so generation is
    unchanged). Returns the head transform it uses.
    """
    bad = [o for o in outputs if o not in SUPPORTED_OUTPUTS]
    if bad:
        raise ValueError(f"fastrehearse's fused head computes {SUPPORTED_OUTPUTS}, not {bad}")
    tr = head_transform(model)
    previous = model.forward
    if verify:
        verify_head(model, tr, previous)
    want_entropy = "entropy" in outputs
    cfg = model.config.get_text_config()
    aux_fn = router_aux_loss_fn(model)
    aux_coef = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                num_items_in_batch=None, fastrehearse_loss=None, **kwargs):
        if not fused_lm_head:
            for k, val in (("labels", labels), ("shift_labels", shift_labels),
                           ("num_items_in_batch", num_items_in_batch)):
                if val is not None:
                    kwargs[k] = val
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        if getattr(cfg, "output_router_logits", False):   # as the model's own forward does
            kwargs.setdefault("output_router_logits", True)
        out = backbone(self)(*args, **kwargs)
        aux = None
        if kwargs.get("output_router_logits"):
            aux = router_aux_loss(self, aux_fn, out, kwargs.get("attention_mask"))
        last = out.last_hidden_state
        head = resolve_head(self)      # PEFT may wrap the head after patching: refused by name
        if fastrehearse_loss is not None:
            res = fastrehearse_loss.run(last, head, tr)
            res.aux_loss = aux
            return res
        if shift_labels is None:
            hidden, labels = last[:, :-1], labels[:, 1:]
        else:
            hidden, labels = last, shift_labels
        labels = labels.to(head.weight.device)
        mask = labels != -100
        with torch.autocast(hidden.device.type, enabled=False):
            x, w = head_inputs(hidden.reshape(-1, hidden.shape[-1]), head)
            logp, ent = linear_logprobs(x, w, labels.clamp(min=0).reshape(-1),
                                        mask=mask.reshape(-1), temperature=temperature,
                                        with_entropy=want_entropy, **head_kwargs(tr, head))
        logp = logp.view(mask.shape)
        n = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -logp.sum() / n
        if aux is not None:
            loss = loss + aux_coef * aux
        return types.SimpleNamespace(
            loss=loss, log_probs=logp, label_mask=mask, aux_loss=aux,
            entropy=None if ent is None else ent.view(mask.shape))

    model.forward = types.MethodType(forward, model)
    return tr
