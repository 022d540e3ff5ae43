"""Worker for tests/test_train_sharded_load.py: build the policy, the reference and the generation
copy of `spec` the way a sharded run does (on meta, sharded, loaded into the shards) and save, on
rank 0, every full parameter of each next to what transformers' from_pretrained loads."""
import sys

import torch

from fastrehearse.train.config import load_config
from fastrehearse.train.export import hf_prefix
from fastrehearse.train.model_init import build_generation_model, build_policy, build_reference
from fastrehearse.train.parallelize import destroy_distributed, exit_worker, init_distributed, iter_full_params


def main(out_path: str, spec: str, ac: str) -> None:
    cfg = load_config("configs/smoke.yaml", [f"model.spec={spec}", "run_dir=/tmp/_fr_unused", "eval.num_tasks=0",
                                             f"model.activation_checkpointing={ac}", "algo.loss.kl_coef=0.01"])
    info = init_distributed("cpu")
    policy, hf_model, _ = build_policy(cfg, info)
    ref = build_reference(cfg, info, policy, hf_model)
    gen = build_generation_model(cfg, info, policy, hf_model)
    p = hf_prefix(policy, hf_model)
    out = {"world_size": info.world_size, "sharded": info.sharded,
           "tied": hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight,
           "policy": {k[len(p):]: v.clone() for k, v in iter_full_params(policy)},
           "ref": {k[len(p):]: v.clone() for k, v in iter_full_params(ref)},
           "ref_frozen": not any(q.requires_grad for q in ref.parameters()),
           "gen": {k: v.detach().clone() for k, v in [*gen.named_parameters(), *gen.named_buffers()]},
           "gen_is_policy_model": gen is hf_model}
    if info.rank == 0:
        torch.save(out, out_path)
    destroy_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_worker(0)   # a torchrun worker skips interpreter finalization; outside torchrun a no-op
