"""float64 references shared by the kernel tests (materialized logits: fine at test sizes)."""
import torch


def ref_logprobs(x, w, t, mask=None, temperature=1.0):
    """logp, entropy in float64 from the same inputs; masked rows are 0."""
    z = (x.double() @ w.double().T) / temperature
    lp = torch.log_softmax(z, dim=-1)
    logp = lp.gather(1, t.clamp(0, w.shape[0] - 1).long().view(-1, 1)).squeeze(1)
    ent = -(lp.exp() * lp).sum(-1)
    if mask is not None:
        logp = torch.where(mask, logp, torch.zeros_like(logp))
        ent = torch.where(mask, ent, torch.zeros_like(ent))
    return logp, ent


def rel_err(a, b):
    a, b = a.double(), b.double()
    den = b.norm()
    if den == 0:
        return float(a.norm())
    return float((a - b).norm() / den)
