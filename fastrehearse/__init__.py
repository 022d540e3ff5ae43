"""fastrehearse: train tool-use LLM agents by world rehearsal (one model, two roles: policy and
environment), with fused Triton loss kernels, packed varlen sequences and an FSDP2 trainer.

Data path (one folder per stage):
    envs/ (tasks) -> rollout/ (episodes, role-tagged tokens) -> packing/ (PackedBatch)
    -> model/ (hidden states) -> kernels (fused loss) + algo/ (advantages) -> train/ (FSDP2, DCP)
    -> eval/
"""
__version__ = "0.1.0"
