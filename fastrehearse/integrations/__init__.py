"""Drop-in adapters that run other RL trainers' LM head through `fastrehearse.kernels`.

    fastrehearse.integrations.trl   FastGRPOTrainer, patch_fused_lm_head      (trl >= 1.16)
    fastrehearse.integrations.verl  linear_cross_entropy, patch_verl          (verl 0.9.x)

Each module imports its peer library only when used, so importing this package needs neither.
See docs/integrations.md.
"""
