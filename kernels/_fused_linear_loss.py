"""The fused LM-head projection + policy loss: one sweep over row chunks, 6NHV FLOPs (not 8NHV).

dl/dlogp and dl/dH are known as soon as logp and H are (advantages and old log-probs are inputs),
so each chunk does Z = X_c W^T -> row stats -> per-token dl/dlogp, dl/dH -> dZ in place ->
dX_c = dZ W, dW += dZ^T X_c. Backward only scales the stored dX, dW (, d bias) by grad_output.
The sweep knows nothing of the loss's formula: it takes each chunk's per-token slopes by autograd
over `_token_loss.token_loss` on the chunk's [C] vectors (the loss, in turn, knows nothing of
chunks or GEMMs). dW accumulates in fp32 across chunks by default (a V x H accumulator, read and
written once per chunk), so the chunk size comes from a workspace budget that counts that
accumulator (`workspace_bytes`, `fused_loss_rows`): few, large chunks hide its traffic behind the
dW GEMM's FLOPs. `dw_accum_dtype=weight.dtype` accumulates in the returned low-precision dW
instead (each chunk's dZ^T X_c summed in fp32 inside the GEMM, the running dW rounded once per
chunk, as Liger's FLCE): no accumulator in the workspace and half its traffic, for k roundings
of dW instead of one (k = number of chunks; relative error <= k * 2^-8 for bf16). Token-level
importance ratios only: a sequence-level ratio couples the tokens of a sequence (its gradient
needs every logp of the sequence first), so importance_sampling="sequence" runs the unfused path.
"""
from __future__ import annotations

import torch

from ._common import FUSED_WORKSPACE_BYTES_CUDA, plan_chunk
from ._rowmath import row_stats, target_grad
from ._token_loss import PolicyLossConfig, rl_mask, token_loss, token_stats
from ._vocab_outer import block_elem_bytes
from .linear_logprobs import chunk_grad, forward_rows, head_logits
from .roles import NUM_ROLES


class _Plan:
    """Everything the fused forward needs besides (x, w), and the per-token results it leaves."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def fast_torch(backend, entropy_grad, head) -> bool:
    """The torch backend without an entropy gradient: dZ = diag(g1) (onehot - E / S) with
    E = exp(s - m), so the chunk needs only amax, sub_, exp_, sum; -g1 / S scales the [C, H]
    operands instead. An entropy wanted as a metric only (entropy_coef == 0, e.g. TRL's logged
    entropy) costs one more row reduction: H = log S - sum_j E_j (s_j - m) / S.
    (Not with an LM-head variant: the head transform sits between the GEMM and the rows.)"""
    return backend == "torch" and not entropy_grad and head is None


def fused_policy_loss(x_c, w, bias, head, inv_temp, batch, cfg: PolicyLossConfig, *, backend,
                      fast, with_entropy, chunk_size, workspace_bytes, dw_accum_dtype):
    """The fused path over the compacted rows x_c (`batch`: their _loss_io.LossRows): the loss,
    and the plan holding the per-token results (logp, ent, ratio, clipped, dual, kl, loss_parts).
    `fast`: the torch fast path (`fast_torch`)."""
    grad_on = torch.is_grad_enabled()
    plan = _Plan(t=batch.targets.long().contiguous(), roles=batch.roles, adv=batch.adv,
                 old=batch.old, ref=batch.ref, pg_w=batch.pg_w, scale=batch.scale, cfg=cfg,
                 inv_temp=inv_temp,
                 with_entropy=with_entropy,
                 backend="triton" if backend == "triton-fused" else backend, head=head,
                 fast=fast, need_dx=grad_on and x_c.requires_grad,
                 need_dw=grad_on and w.requires_grad,
                 need_db=(grad_on and head is not None and bias is not None
                          and bias.requires_grad), dw_dtype=dw_accum_dtype)
    grad = plan.need_dx or plan.need_dw or plan.need_db
    n, v = x_c.shape[0], w.shape[0]
    # 'triton-fused' fuses the forward-only sweep; a gradient needs each chunk's logits for
    # dZ anyway (6NHV in one sweep), so that sweep is the "triton" one
    plan.fused_fwd = backend == "triton-fused" and not grad
    if plan.fused_fwd:
        plan.chunk = forward_rows(n, v, w.dtype, w.device, "triton-fused", chunk_size=chunk_size,
                                  budget=workspace_bytes)
    else:
        plan.chunk = _chunk_rows(n, w, head, plan.fast, grad, plan.need_dw, workspace_bytes,
                                 chunk_size, with_entropy, dw_accum_dtype)
    b = bias if head is not None else None
    if grad:
        loss = _FusedPolicyLoss.apply(x_c.contiguous(), w.contiguous(), b, plan)
    else:
        loss, _ = _fused_sweep(x_c.contiguous(), w.contiguous(), plan, False, False)
    return loss, plan


def fused_loss_rows(n: int, v: int, device: torch.device, *, elem_bytes: int, fixed_bytes: int,
                    workspace_bytes: int | None = None, chunk_size: int | None = None) -> int:
    """Rows per chunk of the sweep.

    Workspace = `fixed_bytes` (the fp32 V x H dW accumulator when dW is needed, plus any other
    V x H copy the path makes) + rows x V x `elem_bytes` (the chunk's fp32 logits, pre-cap
    logits, low-precision dZ). `chunk_size` overrides. Without a budget: on CUDA
    FUSED_WORKSPACE_BYTES_CUDA, but never fewer rows than the logits chunks of `linear_logprobs`'
    forward (256 MiB of fp32 logits); on the CPU those chunks (32 MiB). A budget that cannot
    hold `fixed_bytes` plus one row is refused.
    """
    logits_rows = forward_rows(n, v, None, device, "triton", chunk_size=chunk_size)
    if chunk_size is not None or (workspace_bytes is None and device.type != "cuda"):
        return logits_rows
    return plan_chunk(
        n, max(v, 1) * elem_bytes, workspace_bytes or FUSED_WORKSPACE_BYTES_CUDA,
        fixed_bytes=fixed_bytes, at_least=logits_rows if workspace_bytes is None else None,
        refuse=(f"workspace_bytes={workspace_bytes} cannot hold the fused loss's "
                f"{fixed_bytes}-byte fixed part (the fp32 dW accumulator unless "
                f"dw_accum_dtype=weight.dtype) plus one {v * elem_bytes}-byte row of logits; "
                f"raise it or use fused=False"))


def _chunk_rows(n, w, head, fast, grad, need_dw, workspace_bytes, chunk_size, with_entropy=False,
                dw_accum_dtype=torch.float32):
    """Rows per chunk of _fused_sweep from the workspace it holds (see fused_loss_rows):
    per row of a chunk its fp32 logits (+ pre-cap logits, + a low-precision dZ when there is a
    gradient); fixed: the fp32 V x H dW accumulator (none when dW accumulates in the returned
    low-precision dW itself), and the torch fast path's fp32 weight copy."""
    v, h = w.shape
    pre = 4 if head is not None and head.needs_pre else 0
    # fast path: the chunk's fp32 logits (+ E beside s - m when the entropy is wanted)
    elem = (8 if with_entropy else 4) if fast else (block_elem_bytes(w, head) if grad else 4 + pre)
    acc32 = need_dw and (dw_accum_dtype == torch.float32 or w.dtype == torch.float32)
    fixed = (v * h * 4 if acc32 else 0) + (v * h * 4 if fast and w.dtype != torch.float32 else 0)
    if fast and need_dw and not acc32:
        fixed += v * h * 4     # the fast path's per-chunk fp32 dZ^T X_c before it is rounded in
    return fused_loss_rows(n, v, w.device, elem_bytes=elem, fixed_bytes=fixed,
                           workspace_bytes=workspace_bytes, chunk_size=chunk_size)


def _loss_and_slopes(logp, ent, roles, adv, old, ref, scale, cfg: PolicyLossConfig, pg_w=None):
    """Fused path: the per-token loss l_t (token_loss, the one definition) and its slopes
    scale_t dl_t/dlogp_t, scale_t dl_t/dH_t (None without an entropy term), by autograd over
    token_loss on the chunk's [C] vectors -- no second, hand-derived copy of the loss to keep in
    step. Token-level importance ratios only (a sequence ratio couples a sequence's tokens across
    chunks: that level runs the unfused path)."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_()
        en = ent.detach().requires_grad_() if ent is not None and cfg.entropy_coef != 0.0 else ent
        l = token_loss(lp, en, roles, adv, old, ref, cfg, None, pg_w)
        wrt = [lp] + ([en] if en is not None and en.requires_grad else [])
        slopes = torch.autograd.grad(l, wrt, grad_outputs=scale)
    return l.detach(), slopes[0], (slopes[1] if len(slopes) > 1 else None)


class _FusedPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, plan):
        loss, n = _fused_sweep(x, w, plan, plan.need_dx, plan.need_dw, plan.need_db)
        ctx.save_for_backward(plan.dx, plan.dw, plan.db)
        ctx.used = False
        plan.dx = plan.dw = plan.db = None
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError("the fused policy loss stores its gradients and can be "
                               "backpropagated once; use fused=False for retain_graph / "
                               "higher-order use")
        ctx.used = True
        grads = ctx.saved_tensors
        # grad_out is the scalar upstream gradient (1.0, or a loss scale); scale in place.
        g = grad_out.to(torch.float32)
        for t in grads:
            if t is not None:
                t.mul_(g.to(t.dtype))
        return (*grads, None)


def _fused_sweep(x, w, plan, need_dx, need_dw, need_db=False):
    n, v = x.shape[0], w.shape[0]
    dev = x.device
    head = plan.head
    plan.logp = torch.empty(n, device=dev, dtype=torch.float32)
    plan.ent = torch.empty(n, device=dev, dtype=torch.float32) if plan.with_entropy else None
    plan.ratio = torch.empty(n, device=dev, dtype=torch.float32)
    plan.clipped = torch.empty(n, device=dev, dtype=torch.bool)
    plan.dual = torch.empty(n, device=dev, dtype=torch.bool)
    plan.kl = torch.empty(n, device=dev, dtype=torch.float32) if plan.cfg.kl_coef else None
    loss_parts = torch.zeros(NUM_ROLES, device=dev, dtype=torch.float32)
    dx = torch.empty_like(x) if need_dx else None
    dw = torch.zeros(w.shape, device=dev, dtype=plan.dw_dtype) if need_dw else None
    db = torch.zeros(v, device=dev, dtype=torch.float32) if need_db else None
    grad = need_dx or need_dw or need_db
    inv_temp = plan.inv_temp
    fast = plan.fast
    w32 = (w if w.dtype == torch.float32 else w.float()) if fast else None
    for s in range(0, n, plan.chunk):
        e = min(n, s + plan.chunk)
        x_c, t_c, r_c = x[s:e], plan.t[s:e], plan.roles[s:e]
        z_pre = None
        if fast:
            xs = x_c.float() if inv_temp == 1.0 else x_c.float() * inv_temp    # x / T
            z = torch.mm(xs, w32.t())
            ti = t_c.view(-1, 1)
            s_t = z.gather(1, ti).squeeze(1)
            m = z.amax(1)
            sm_t = s_t - m
            e_t = torch.exp(sm_t)
            # E with each row's target entry zeroed: its sum is the off-target mass A S, and the
            # target coefficient of dZ below is g1 A, never the cancelling g1 (1 - E_t / S)
            if plan.with_entropy:                                 # metric only: no gradient
                zm = z.sub_(m.view(-1, 1))                            # s - m
                z = zm.exp().scatter_(1, ti, 0.0)                     # z := E (off-target)
                a = torch.bmm(z.unsqueeze(1), zm.unsqueeze(2)).view(-1) + e_t * sm_t
                del zm                                                # a = sum_j E_j (s_j - m)
                sum_off = z.sum(1)
                sum_e = sum_off + e_t
                h = torch.log(sum_e) - a / sum_e
            else:
                sum_off = z.sub_(m.view(-1, 1)).exp_().scatter_(1, ti, 0.0).sum(1)   # z := E
                sum_e = sum_off + e_t
                h = None
            lp = sm_t - torch.log(sum_e)
        elif plan.fused_fwd:
            from ._fused_lse import fused_row_stats    # lazy: triton only when it is used
            lp, h, _, _, _ = fused_row_stats(x_c, w, t_c, inv_temp, plan.with_entropy)
            z = None
        else:
            z, z_pre = head_logits(x_c, w, head, plan.backend)
            lp, h, lse, off, off_ent = row_stats(z, t_c, inv_temp, plan.with_entropy, plan.backend)
        old_c = None if plan.old is None else plan.old[s:e]
        ref_c = None if plan.ref is None else plan.ref[s:e]
        if old_c is None:                                    # on-policy: ratio exactly 1
            lr = torch.zeros_like(lp)
        else:
            lr = torch.where(rl_mask(r_c), lp - old_c, torch.zeros_like(lp))
        l, g1, g2 = _loss_and_slopes(lp, h, r_c, plan.adv[s:e], old_c, ref_c, plan.scale[s:e], plan.cfg,
                                     None if plan.pg_w is None else plan.pg_w[s:e])
        ratio, clipped, dual, kl = token_stats(lp, r_c, plan.adv[s:e], lr, ref_c, plan.cfg)
        loss_parts.index_add_(0, r_c, l * plan.scale[s:e])
        plan.logp[s:e] = lp
        if plan.ent is not None:
            plan.ent[s:e] = h
        plan.ratio[s:e], plan.clipped[s:e], plan.dual[s:e] = ratio, clipped, dual
        if kl is not None:
            plan.kl[s:e] = kl
        if grad and fast:
            r = (-g1 / sum_e).view(-1, 1)
            g1c = (g1 * (sum_off / sum_e)).view(-1, 1)          # the target entry g1 A
            if dx is not None:
                dx_c = torch.mm(z, w32).mul_(r).add_(w32.index_select(0, t_c) * g1c)
                dx[s:e] = dx_c.mul_(inv_temp) if inv_temp != 1.0 else dx_c
            if dw is not None and dw.dtype == torch.float32:
                dw.addmm_(z.t(), xs * r)
                dw.index_add_(0, t_c, xs * g1c)
            elif dw is not None:    # low-precision dW: the chunk's sum in fp32, rounded in once
                dw.add_(torch.mm(z.t(), xs * r).index_add_(0, t_c, xs * g1c))
        elif grad:
            dt = target_grad(lp, h, off, off_ent, g1, g2)
            chunk_grad(x_c, w, z, t_c, lse, h, g1, g2, dt, inv_temp, plan.backend,
                       None if dx is None else dx[s:e], dw, head, z_pre, db)
        del z, z_pre
    plan.dx = dx
    plan.dw = None if dw is None else dw.to(w.dtype)
    plan.db = None if db is None else db.to(head.bias_dtype)
    plan.loss_parts = loss_parts
    return loss_parts.sum(), n
