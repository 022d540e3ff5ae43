"""Token sampling with per-row generators (an episode's samples do not depend on its batch-mates).

`sample(logits, temperature, top_p, uniforms)`:
  logp = log_softmax(logits / T)            the recorded rollout log-prob (before top-p truncation,
                                            i.e. what the trainer recomputes at temperature T)
  top-p: keep the smallest prefix of tokens sorted by probability whose mass reaches top_p (at least
         one), renormalize, and pick by inverse CDF with one uniform number per row.
  T == 0: greedy; the recorded log-prob is then log_softmax(logits) (T = 1).
"""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32, uniforms [B] in [0, 1) -> (tokens [B] long, logp [B] fp32)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        logp_all = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
        return tok, logp_all.gather(1, tok[:, None]).squeeze(1)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp_all.exp()
    if top_p < 1.0:
        sp, si = probs.sort(dim=-1, descending=True)
        before = sp.cumsum(-1) - sp            # mass strictly before each token
        sp = sp.masked_fill(before >= top_p, 0.0)
        cdf = sp.cumsum(-1)
        j = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True)
        j = j.clamp(max=sp.shape[1] - 1)
        tok = si.gather(1, j).squeeze(1)
    else:
        cdf = probs.cumsum(-1)
        j = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1), right=True)
        j = j.clamp(max=probs.shape[1] - 1)
        tok = j.squeeze(1)
    # searchsorted(right=True) picks the first token whose CDF exceeds u * mass, which always has
    # mass; only float rounding at the very top (u * mass == mass) can clamp onto a zero-mass tail
    # token, which falls back to the most likely token.
    zero = probs.gather(1, tok[:, None]).squeeze(1) <= 0
    if zero.any():
        tok = torch.where(zero, probs.argmax(-1), tok)
    return tok, logp_all.gather(1, tok[:, None]).squeeze(1)
