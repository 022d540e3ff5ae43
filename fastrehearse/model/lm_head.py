"""How each transformers model family turns its LM head's output into logits: the one head spec.

fastrehearse's trainer (`model/adapter.py`) and the TRL adapter (`integrations/trl.py`) both read a
model's head through `head_settings(model)`, so they cannot disagree about a model. The kernels
express exactly  logits = c tanh(a (h W^T + b) / c)  (scale a, bias b, soft-cap c; see
`kernels/_head.py`). Read off the CausalLM forwards of transformers 5.23 (`modeling_<type>.py`):

    cohere, cohere2, cohere2_moe                 logits * logit_scale
    granite, granitemoe(shared|hybrid), *_swa    logits / logits_scaling
    hyperclovax                                  logits * logits_scaling   (MuP: the reverse of Granite)
    falcon_h1                                    logits * lm_head_multiplier
    minicpm3                                     lm_head(hidden / logits_scaling), a bias-free head
    gemma2, gemma3_text, vaultgemma, nanochat, beam
                                                 cap * tanh(logits / cap), cap = final_logit_softcapping
    recurrent_gemma                              the same with cap = logits_soft_cap

Multimodal models are looked up by their text config's type (Gemma 3's is gemma3_text).
A model type not listed that sets any of these keys to a non-neutral value is refused (we do not
know where, or whether, its forward applies it); TRL 1.16 instead applies `logit_scale`,
`output_multiplier`, `lm_head_multiplier`, `logits_scaling` and `final_logit_softcapping` to every
model, which is wrong for a model that carries such a key without using it.
tests/test_kernel_model_heads.py builds a tiny random model of every listed type and checks the
spec against its own logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class HeadRule:
    """Where a family's forward reads its head transform from its (text) config."""
    scale_key: str | None = None     # config key of a logit multiplier
    divide: bool = False             # logits / config[scale_key] (Granite) instead of *
    scale_on_hidden: bool = False    # the scale is applied to the hidden states before the head
    softcap_key: str | None = None   # cap * tanh(logits / cap), after the scale


_COHERE = HeadRule("logit_scale")
_GRANITE = HeadRule("logits_scaling", divide=True)
_GEMMA = HeadRule(softcap_key="final_logit_softcapping")

HEAD_RULES: dict[str, HeadRule] = {
    "cohere": _COHERE, "cohere2": _COHERE, "cohere2_moe": _COHERE,
    "granite": _GRANITE, "granitemoe": _GRANITE, "granitemoeshared": _GRANITE,
    "granitemoehybrid": _GRANITE, "granite_swa": _GRANITE, "granitemoe_swa": _GRANITE,
    "hyperclovax": HeadRule("logits_scaling"),
    "falcon_h1": HeadRule("lm_head_multiplier"),
    # minicpm3: hidden / s before a bias-free head == logits / s (a bias is refused below)
    "minicpm3": HeadRule("logits_scaling", divide=True, scale_on_hidden=True),
    "gemma2": _GEMMA, "gemma3_text": _GEMMA, "vaultgemma": _GEMMA,
    "nanochat": _GEMMA, "beam": _GEMMA,
    "recurrent_gemma": HeadRule(softcap_key="logits_soft_cap"),
}

# Config keys that change the logits in some transformers model, with their neutral value (None:
# any value is a transform). On a model type not in HEAD_RULES a non-neutral value is refused.
HEAD_KEYS: dict[str, float | None] = {
    "final_logit_softcapping": None, "logits_soft_cap": None, "logit_scale": 1.0,
    "logits_scaling": 1.0, "lm_head_multiplier": 1.0, "output_multiplier": 1.0}


class HeadSpecError(ValueError):
    """The model's logits are something the kernels cannot express (or we do not know how)."""


def head_module(model: nn.Module) -> nn.Module:
    """The output embedding (the input embedding when a tied model has no head module)."""
    head = model.get_output_embeddings()
    return model.get_input_embeddings() if head is None else head


def _rule(model: nn.Module):
    cfg = model.config.get_text_config()
    for mtype in (getattr(cfg, "model_type", None), getattr(model.config, "model_type", None)):
        if mtype in HEAD_RULES:
            return cfg, mtype, HEAD_RULES[mtype]
    return cfg, getattr(cfg, "model_type", "?"), None


def head_settings(model: nn.Module) -> dict[str, float]:
    """{'logit_scale': a, 'logit_softcap': c}: the entries of this model's head transform that are set.

    Raises HeadSpecError naming the setting when the model transforms its logits in a way the kernels
    cannot express, or that fastrehearse does not know how this model type applies.
    """
    cfg, mtype, rule = _rule(model)
    name = type(model).__name__
    out: dict[str, float] = {}
    handled: set[str] = set()
    if rule is not None and rule.scale_key is not None:
        handled.add(rule.scale_key)
        val = getattr(cfg, rule.scale_key, None)
        if val is not None and float(val) != 1.0:
            if not (math.isfinite(float(val)) and float(val) != 0.0):
                raise HeadSpecError(f"{name} ({mtype}) config has {rule.scale_key}={val}: cannot "
                                    "score log-probs with it")
            if rule.scale_on_hidden and getattr(head_module(model), "bias", None) is not None:
                raise HeadSpecError(f"{name} ({mtype}) scales the hidden states by "
                                    f"{rule.scale_key} before an LM head with a bias: the kernels "
                                    "scale (h W^T + b) and cannot express it")
            out["logit_scale"] = 1.0 / float(val) if rule.divide else float(val)
    if rule is not None and rule.softcap_key is not None:
        handled.add(rule.softcap_key)
        cap = getattr(cfg, rule.softcap_key, None)
        if cap is not None:
            if not (math.isfinite(float(cap)) and float(cap) > 0.0):
                raise HeadSpecError(f"{name} ({mtype}) config has {rule.softcap_key}={cap}: "
                                    "must be > 0")
            out["logit_softcap"] = float(cap)
    for key, neutral in HEAD_KEYS.items():
        val = getattr(cfg, key, None)
        if key in handled or val is None or (neutral is not None and val == neutral):
            continue
        raise HeadSpecError(
            f"{name} ({mtype}) config sets {key}={val!r}, which changes its logits in a way "
            "fastrehearse's LM-head kernels do not know for this model type; refusing it rather "
            "than training on wrong log-probs")
    return out


def head_kwargs(model: nn.Module) -> dict:
    """Keyword arguments for fastrehearse.kernels (bias, logit_scale, logit_softcap) that make the
    kernels compute this model's own logits from its final hidden states; {} for a plain head."""
    kw: dict = dict(head_settings(model))
    bias = getattr(head_module(model), "bias", None)
    if bias is not None:
        kw["bias"] = bias
    return kw


def hidden_multiplier(model: nn.Module) -> float:
    """The factor a family applies to the hidden states before its head (MiniCPM3: 1/logits_scaling),
    1.0 for the others; head_settings already folds it into 'logit_scale'."""
    cfg, _, rule = _rule(model)
    if rule is None or not rule.scale_on_hidden:
        return 1.0
    val = getattr(cfg, rule.scale_key, None)
    if val is None:
        return 1.0
    return 1.0 / float(val) if rule.divide else float(val)
