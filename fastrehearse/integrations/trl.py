"""TRL adapter: GRPOTrainer's LM head (and, where expressible, its loss) through fastrehearse.kernels.

    from fastrehearse.integrations.trl import FastGRPOTrainer
    trainer = FastGRPOTrainer(model=model, args=GRPOConfig(...), reward_funcs=..., train_dataset=...)
    trainer.train()

Two layers, each usable alone:

* `patch_fused_lm_head(model, temperature)` replaces TRL's fused-LM-head protocol
  (`model(..., labels=labels, fused_lm_head=True)` -> `.log_probs`, `.entropy`, which every TRL
  1.16 trainer uses) by `linear_logprobs`: the shift by one position, -100 labels as a bool mask
  (masked rows cost nothing), the LM head's bias / final logit soft-capping / logit scale read from
  the model and checked against the model's own logits once, autocast switched off around the head
  (the hidden states are cast to the head weight's dtype, as TRL's `cast_lm_head_to_fp32` does for
  fp32 heads).
* `FastGRPOTrainer` patches the policy and reference models that way and computes GRPO's loss with
  the fused `linear_policy_loss` when the configuration is expressible (see `_fused_loss_blocker`),
  reproducing TRL's per-`loss_type` normalizers as per-token weights; otherwise it runs TRL's own
  loss on the fastrehearse log-probs, with a one-time warning naming why.

trl is imported only when `FastGRPOTrainer` is first used; this module imports without it.
"""
from __future__ import annotations

import functools
import types
import warnings
from dataclasses import dataclass

import torch

from fastrehearse.kernels import (PolicyLossConfig, Role, linear_logprobs, linear_policy_loss)

__all__ = ["FastGRPOTrainer", "patch_fused_lm_head", "head_transform", "UnsupportedModelError"]

_SUPPORTED_OUTPUTS = ("log_probs", "entropy")
_warned: set[str] = set()


class UnsupportedModelError(ValueError):
    """The model's LM head does something the kernels cannot express (never scored wrongly)."""


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


# ---- the LM head: what the model's forward does after the backbone --------------------------


@dataclass(frozen=True)
class HeadTransform:
    """logits = softcap(logit_scale * (h @ W.T + bias)), softcap(z) = c tanh(z / c)."""
    has_bias: bool
    logit_softcap: float | None
    logit_scale: float | None


def head_transform(model) -> HeadTransform:
    """Read the head's transforms from the HF config the way TRL 1.16's fused head does.

    Raises UnsupportedModelError for heads the kernels cannot run (non-Linear heads such as a
    PEFT-wrapped lm_head). Transforms no config field announces are caught by `verify_head`.
    """
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the LM head is a {type(head).__name__}, not a plain "
            "torch.nn.Linear (e.g. a PEFT adapter on lm_head); fastrehearse cannot score it")
    cfg = model.config.get_text_config()
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scale = getattr(cfg, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(cfg, name, None)
    if scale is None and getattr(cfg, "logits_scaling", None) is not None:
        scale = cfg.logits_scaling if cfg.model_type == "hyperclovax" else 1.0 / cfg.logits_scaling
    scale = None if scale is None or float(scale) == 1.0 else float(scale)
    softcap = None if softcap is None else float(softcap)
    return HeadTransform(head.bias is not None, softcap, scale)


def _full(t):
    """FSDP2 shards parameters as DTensors; the kernels need the whole head."""
    full = getattr(t, "full_tensor", None)
    return t if full is None else full()


def _head_kwargs(tr: HeadTransform, head) -> dict:
    kw = {}
    if tr.has_bias:
        kw["bias"] = _full(head.bias)
    if tr.logit_softcap is not None:
        kw["logit_softcap"] = tr.logit_softcap
    if tr.logit_scale is not None:
        kw["logit_scale"] = tr.logit_scale
    return kw


def _reference_logits(h, head, tr: HeadTransform):
    z = h.double() @ head.weight.double().t()
    if head.bias is not None:
        z = z + head.bias.double()
    if tr.logit_scale is not None:
        z = z * tr.logit_scale
    if tr.logit_softcap is not None:
        z = tr.logit_softcap * torch.tanh(z / tr.logit_softcap)
    return z


@torch.no_grad()
def verify_head(model, tr: HeadTransform, forward, backbone, seq_len: int = 8) -> None:
    """Compare the model's own logits with the transform read from its config on a short input.

    Catches head transforms no config field announces (custom forwards): raises
    UnsupportedModelError naming the largest difference. Runs in eval mode (no dropout).
    """
    head = model.get_output_embeddings()
    v = head.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v, (1, seq_len), generator=g).to(head.weight.device)
    was_training = model.training
    model.eval()
    try:
        logits = forward(input_ids=ids, use_cache=False).logits.double()
        h = backbone(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        model.train(was_training)
    ref = _reference_logits(h.to(head.weight.device), head, tr)
    if logits.shape != ref.shape:
        raise UnsupportedModelError(
            f"{type(model).__name__}: logits of shape {tuple(logits.shape)} but the LM head "
            f"gives {tuple(ref.shape)}; fastrehearse cannot score this model")
    # the model's logits are rounded to its dtype (TF32 GEMMs on CUDA if enabled); a transform
    # the config does not announce (a softcap, a scale) moves them by far more
    eps = torch.finfo(head.weight.dtype).eps
    if head.weight.is_cuda and eps < 2**-10 and torch.backends.cuda.matmul.allow_tf32:
        eps = 2**-10
    tol = 8 * eps * (1.0 + float(ref.abs().max()))
    err = float((logits - ref).abs().max())
    if not err <= tol:
        raise UnsupportedModelError(
            f"{type(model).__name__}: its logits differ from softcap(scale * (h W^T + b)) with "
            f"{tr} by {err:.3g} (tolerance {tol:.3g}); the head does something fastrehearse "
            "cannot express, refusing it")


def _backbone(model):
    # The backbone is looked up per call (FSDP / PEFT replace modules after patching), as TRL does.
    return model.base_model


def _head_inputs(hidden, head):
    """(hidden, weight) for the kernels: no autocast, hidden in the weight's dtype, DTensors gathered."""
    weight = _full(head.weight)
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return hidden.to(weight.device), weight


def patch_fused_lm_head(model, temperature: float = 1.0, outputs=("log_probs",),
                        verify: bool = True) -> HeadTransform:
    """Make `model(..., labels=labels, fused_lm_head=True)` return fastrehearse log-probs.

    The same contract as `trl.trainer.utils.add_fused_lm_head` (its outputs `log_probs` and
    `entropy` are supported; the others raise): per-token fields are [B, T-1] (or [B, T] with
    `shift_labels`), exactly 0 where the label is -100. Any other call goes to the forward the model
    had before (so generation is unchanged). Returns the head transform it uses.
    """
    bad = [o for o in outputs if o not in _SUPPORTED_OUTPUTS]
    if bad:
        raise ValueError(f"fastrehearse's fused head computes {_SUPPORTED_OUTPUTS}, not {bad}")
    tr = head_transform(model)
    cfg = model.config.get_text_config()
    if getattr(cfg, "output_router_logits", False):
        raise UnsupportedModelError(f"{type(model).__name__}: MoE router aux loss through the "
                                    "fused head is not supported by fastrehearse")
    previous = model.forward
    if verify:
        verify_head(model, tr, previous, _backbone(model))
    want_entropy = "entropy" in outputs

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                num_items_in_batch=None, fastrehearse_loss=None, **kwargs):
        if not fused_lm_head:
            for k, val in (("labels", labels), ("shift_labels", shift_labels),
                           ("num_items_in_batch", num_items_in_batch)):
                if val is not None:
                    kwargs[k] = val
            return previous(*args, **kwargs)
        if kwargs.get("output_router_logits"):
            raise UnsupportedModelError("output_router_logits with fastrehearse's fused head")
        kwargs["use_cache"] = False
        last = _backbone(self)(*args, **kwargs).last_hidden_state
        head = self.get_output_embeddings()
        if type(head) is not torch.nn.Linear:  # e.g. PEFT wrapped lm_head after patching
            raise UnsupportedModelError(f"the LM head became a {type(head).__name__}")
        if fastrehearse_loss is not None:
            return fastrehearse_loss.run(last, head, tr)
        if shift_labels is None:
            hidden, labels = last[:, :-1], labels[:, 1:]
        else:
            hidden, labels = last, shift_labels
        labels = labels.to(head.weight.device)
        mask = labels != -100
        with torch.autocast(hidden.device.type, enabled=False):
            x, w = _head_inputs(hidden.reshape(-1, hidden.shape[-1]), head)
            logp, ent = linear_logprobs(x, w, labels.clamp(min=0).reshape(-1),
                                        mask=mask.reshape(-1), temperature=temperature,
                                        with_entropy=want_entropy, **_head_kwargs(tr, head))
        logp = logp.view(mask.shape)
        n = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return types.SimpleNamespace(
            loss=-logp.sum() / n, log_probs=logp, label_mask=mask, aux_loss=None,
            entropy=None if ent is None else ent.view(mask.shape))

    model.forward = types.MethodType(forward, model)
    return tr


# ---- the fused GRPO loss ------------------------------------------------------------------------


@dataclass
class _LossRequest:
    """Everything the fused loss needs besides the backbone output, passed through model(...)
    so DDP / FSDP wrappers see an ordinary forward call."""
    completion_ids: torch.Tensor      # [B, C]
    mask: torch.Tensor                # [B, C] bool: tokens that carry loss
    advantages: torch.Tensor          # [B, C] float
    old_logp: torch.Tensor | None     # [B, C] or None (on-policy: no extra pass)
    ref_logp: torch.Tensor | None     # [B, C] when beta != 0
    token_weights: torch.Tensor       # [B, C]: TRL's normalizer as a per-token factor
    config: PolicyLossConfig
    with_entropy: bool = True         # for TRL's "entropy" metric (the bonus forces it on)
    out: object = None

    def run(self, last, head, tr):
        b, c = self.completion_ids.shape
        hidden = last[:, -c - 1:-1].reshape(b * c, -1)
        roles = torch.where(self.mask, int(Role.ACT), int(Role.CONTEXT)).reshape(-1)
        with torch.autocast(hidden.device.type, enabled=False):
            x, w = _head_inputs(hidden, head)
            flat = lambda t: None if t is None else t.reshape(-1).float()  # noqa: E731
            seq = None
            if self.config.importance_sampling == "sequence":  # GSPO: one ratio per completion
                seq = torch.arange(b, device=x.device).repeat_interleave(c)
            out = linear_policy_loss(
                x, w, self.completion_ids.reshape(-1), roles, flat(self.advantages),
                flat(self.old_logp), self.config, ref_logp=flat(self.ref_logp),
                token_weights=flat(self.token_weights), with_entropy=self.with_entropy, seq_ids=seq,
                **_head_kwargs(tr, head))
        self.out = out
        return types.SimpleNamespace(
            loss=out.loss, log_probs=out.logp.view(b, c),
            entropy=None if out.entropy is None else out.entropy.view(b, c))


def _grpo_trainer_class():
    from trl import GRPOTrainer  # the peer is imported only when the adapter is used
    return GRPOTrainer


class _FastGRPOMixin:
    """Methods FastGRPOTrainer adds on top of trl.GRPOTrainer (see the module docstring)."""

    fused_loss: bool = True
    entropy_metric: bool = True

    def _fastrehearse_setup(self, fused_loss: bool, entropy_metric: bool) -> None:
        self.fused_loss = fused_loss
        self.entropy_metric = entropy_metric
        self.fused_loss_calls = 0     # how many loss calls took the fused path (tests, benchmark)
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self.head_transform = patch_fused_lm_head(base, self.temperature,
                                                  outputs=("log_probs", "entropy"))
        if self.ref_model is not None:
            patch_fused_lm_head(self.ref_model, self.temperature)

    # -- which configurations the fused loss reproduces exactly --
    def _fused_loss_blocker(self, inputs) -> str | None:
        a = self.args
        if not self.fused_loss:
            return "fused_loss=False"
        if self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo"):
            return f"loss_type={self.loss_type!r} has no fused form"
        if self.importance_sampling_level not in ("token", "sequence"):
            return f"importance_sampling_level={self.importance_sampling_level!r}"
        if self.loss_type == "cispo" and not self.epsilon_high >= 1.0:
            # TRL's CISPO weight is min(ratio, epsilon_high); the kernel's min(ratio, 1 + clip_high)
            return f"loss_type='cispo' with epsilon_high={self.epsilon_high} < 1"
        if self.off_policy_mask_threshold is not None:
            return "off_policy_mask_threshold needs the log-probs before the loss"
        if self.top_entropy_quantile < 1.0:
            return "top_entropy_quantile < 1 needs the entropies before the loss"
        if self.use_vllm and self.vllm_importance_sampling_correction:
            return "vLLM importance-sampling correction"
        if self.aux_loss_enabled:
            return "MoE aux loss"
        if getattr(self, "use_adaptive_entropy", False):
            return "use_adaptive_entropy=True"
        if (self.loss_type != "cispo" and a.delta is not None
                and not a.delta > 1.0 + self.epsilon_high):
            return f"delta={a.delta} <= 1 + epsilon_high clips positive advantages too"
        if not 0.0 <= self.epsilon_low < 1.0:
            return f"epsilon_low={self.epsilon_low} outside [0, 1)"
        if any(k.startswith(("pixel_", "image_", "num_images", "token_type", "mm_token",
                             "spatial_", "num_tiles")) and v is not None
               for k, v in inputs.items()):
            return "multimodal inputs"
        return None

    def _token_weights(self, mask, inputs, mode):
        """TRL's loss normalizer per loss_type as a per-token factor c_t (loss = sum c_t l_t)."""
        b = mask.shape[0]
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        m = mask.to(torch.float64)
        if self.loss_type == "grpo":
            c = 1.0 / (b * m.sum(-1, keepdim=True).clamp(min=1.0) * ga)
        elif self.loss_type == "bnpo":
            c = 1.0 / (m.sum().clamp(min=1.0) * ga)
        elif self.loss_type == "dr_grpo":
            c = torch.tensor(1.0 / (b * self.max_completion_length * ga), dtype=torch.float64)
        elif self.loss_type in ("dapo", "cispo"):
            norm = inputs["num_items_in_batch"].to(torch.float64).clamp(min=1.0)
            norm = norm / self.accelerator.num_processes
            if mode == "train":
                norm = norm * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            c = 1.0 / norm
        else:  # luspo at token level: (l * mask).sum(-1).mean()
            c = torch.tensor(1.0 / (b * ga), dtype=torch.float64)
        return (c * m).to(mask.device)

    def _compute_loss(self, model, inputs):
        why = self._fused_loss_blocker(inputs)
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        tw = None
        if why is None:
            tw = self._token_weights(mask, inputs, mode)
            ent_coef = 0.0
            if self._entropy_bonus_enabled:
                # TRL: loss -= coef * sum(H m) / sum(m) / GA; the kernel: -coef' * sum(c_t H_t)
                ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
                e = mask.to(torch.float64) / (mask.sum().clamp(min=1.0) * ga)
                on = mask.bool()
                ratio = e[on] / tw[on] if bool(on.any()) else e.new_ones(1)
                if float(ratio.max() - ratio.min()) > 1e-12 * float(ratio.abs().max()):
                    why = (f"entropy bonus with loss_type={self.loss_type!r}: TRL weights it per "
                           "token, the policy term per sequence")
                else:
                    ent_coef = float(self.entropy_coef) * float(ratio[0])
        if why is not None:
            if why != "fused_loss=False":
                _warn_once(why, f"FastGRPOTrainer: TRL's own loss on fastrehearse log-probs "
                                f"({why})")
            return super()._compute_loss(model, inputs)
        return self._fused_compute_loss(model, inputs, mask, tw, ent_coef, mode)

    def _fused_compute_loss(self, model, inputs, mask, tw, ent_coef, mode):
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        adv = inputs["advantages"]
        adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand_as(completion_ids)
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        cispo = self.loss_type == "cispo"
        cfg = PolicyLossConfig(
            clip_low=self.epsilon_low,
            clip_high=self.epsilon_high - 1.0 if cispo else self.epsilon_high,
            dual_clip=None if cispo else self.args.delta,   # = TRL's delta when > 1 + eps_high
            pg_loss="cispo" if cispo else "ppo_clip",
            importance_sampling=self.importance_sampling_level,
            kl_coef=float(self.beta), kl_type="k3",
            kl_ratio=bool(self.beta != 0.0 and self.args.use_bias_correction_kl),
            entropy_coef=ent_coef, temperature=float(self.temperature))
        req = _LossRequest(completion_ids, mask.bool(), adv.float(), old, ref, tw, cfg,
                           with_entropy=self.entropy_metric or ent_coef != 0.0)
        out = model(input_ids=input_ids, attention_mask=attention_mask, fused_lm_head=True,
                    fastrehearse_loss=req)
        self.fused_loss_calls += 1
        loss = out.loss
        self._log_fused_metrics(out.log_probs, out.entropy, old, ref, mask, adv, mode)
        if self._entropy_bonus_enabled:
            ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            h = (out.entropy * mask).sum() / mask.sum().clamp(min=1.0) / ga
            policy = loss.detach() + float(self.entropy_coef) * h   # TRL's policy-only loss
            if self.loss_type not in ("dapo", "cispo"):
                policy = policy * ga
            self._metrics[mode]["policy_loss"].append(
                self.accelerator.gather(policy).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss

    def _log_fused_metrics(self, logp, ent, old, ref, mask, adv, mode):
        """The metrics TRL's _compute_loss logs, from the kernel's detached log-probs."""
        maskf = mask.float()

        def global_masked_mean(x):
            if x.shape[1] == 1:  # sequence level: one value per sequence
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * maskf).sum(), maskf.sum()])
            totals = self.accelerator.reduce(local, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def masked_seq_mean(x):
            return x.squeeze(1) if x.shape[1] == 1 else (x * maskf).sum(-1) / maskf.sum(-1)

        log_ratio = logp - (logp if old is None else old)
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1 = torch.exp(log_ratio)
        adv = adv[:, :1] if coef_1.shape[1] == 1 else adv
        m = self._metrics[mode]
        if self.beta != 0.0:
            d = ref - logp
            kl = torch.exp(d) - d - 1
            m["kl"].append(global_masked_mean(kl * coef_1 if self.args.use_bias_correction_kl
                                              else kl))
        if ent is not None:
            m["entropy"].append(global_masked_mean(ent))
        if self.loss_type == "cispo":
            m["cispo_clip_ratio"].append(global_masked_mean(
                ((coef_1 > self.epsilon_high) & (adv > 0)).float()))
            return
        lo = ((coef_1 < 1 - self.epsilon_low) & (adv < 0)).float()
        hi = ((coef_1 > 1 + self.epsilon_high) & (adv > 0)).float()
        m["clip_ratio/low_mean"].append(global_masked_mean(lo))
        m["clip_ratio/high_mean"].append(global_masked_mean(hi))
        m["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(lo, hi)))
        from trl.trainer.utils import nanmax, nanmin
        m["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(lo))).item())
        m["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(hi))).item())


@functools.lru_cache(maxsize=1)
def _fast_grpo_class():
    base = _grpo_trainer_class()

    class FastGRPOTrainer(_FastGRPOMixin, base):
        """trl.GRPOTrainer with fastrehearse's LM head and, where expressible, its fused loss.

        `fused_loss=False` keeps TRL's own loss (on fastrehearse log-probs).
        `entropy_metric=False` skips the per-token entropy the fused loss computes only for
        TRL's "entropy" log entry (faster; TRL's own loss path always computes it)."""

        def __init__(self, *args, fused_loss: bool = True, entropy_metric: bool = True,
                     **kwargs):
            super().__init__(*args, **kwargs)
            self._fastrehearse_setup(fused_loss, entropy_metric)

    FastGRPOTrainer.__module__ = __name__
    return FastGRPOTrainer


def __getattr__(name):
    # PEP 562: `from fastrehearse.integrations.trl import FastGRPOTrainer` imports trl only then.
    if name == "FastGRPOTrainer":
        return _fast_grpo_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
