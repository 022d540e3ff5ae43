"""What only CUDA runs in the vLLM backend (fastrehearse/rollout/backends/vllm_backend.py), checked against a
fake engine that records its calls: sleep mode around the update and the wake order of the weight
sync. Plus the streaming of weights (one full tensor alive at a time, tied heads served twice)
and the refusal of tensor parallelism. None of this needs vLLM installed."""
import gc
import weakref

import pytest
import torch
from torch import nn

from fastrehearse.rollout.backends.vllm_backend import (
    VLLMBackend,
    load_into_engine,
    serving_weights,
)
from fastrehearse.rollout.backends.vllm_options import VLLMOptions


class FakeLLM:
    def __init__(self, calls):
        self.calls = calls

    def sleep(self, level):
        self.calls.append(f"sleep:{level}")


class FakeEngine:
    """The attributes VLLMBackend.release / load_into_engine use, on CUDA."""

    def __init__(self):
        self.calls, self.cuda, self.asleep, self._owner = [], True, False, {}
        self.llm = FakeLLM(self.calls)
        self.loaded = []

    def _empty_cache(self):
        self.calls.append("empty_cache")

    def _wake(self, tags):
        self.calls.append("wake:" + ",".join(tags))

    def _reload(self, weights):
        self.calls.append("reload")
        self.loaded = [name for name, _ in weights]

    def _reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def test_release_sleeps_level_2_and_sync_wakes_weights_before_the_kv_cache():
    e = FakeEngine()
    VLLMBackend.release(e)
    VLLMBackend.release(e)            # already asleep: not twice
    assert e.calls == ["sleep:2"] and e.asleep
    load_into_engine(e, iter([("a", torch.zeros(1)), ("b", torch.zeros(1))]))
    # cached blocks back first, then weight memory, the load, and only then the KV cache
    assert e.calls == ["sleep:2", "empty_cache", "wake:weights", "reload", "wake:kv_cache", "reset_prefix_cache"]
    assert e.loaded == ["a", "b"] and not e.asleep


def test_awake_engine_and_cpu_engine_load_without_sleep_calls():
    e = FakeEngine()
    load_into_engine(e, iter([("a", torch.zeros(1))]))
    assert e.calls == ["reload", "reset_prefix_cache"]
    cpu = FakeEngine()
    cpu.cuda = False
    VLLMBackend.release(cpu)          # vLLM's CPU build has no sleep mode
    assert cpu.calls == [] and not cpu.asleep


def test_release_refuses_requests_in_flight():
    e = FakeEngine()
    e._owner = {"r0": object()}
    with pytest.raises(RuntimeError, match="in flight"):
        VLLMBackend.release(e)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(11, 4)
        self.model.norm = nn.LayerNorm(4)


def test_serving_weights_stream_one_tensor_at_a_time_in_the_serving_dtype():
    """No staging copy: the generator holds no yielded tensor once the consumer dropped it (each
    is a fresh bf16 cast here, as a gathered shard would be), and a tied embedding is also served
    as lm_head.weight."""
    m = Tiny()
    alive, names = [], []
    for name, t in serving_weights(m, torch.bfloat16, tied=True):
        gc.collect()
        # the only earlier tensor alive may be this one itself (the tied head served twice)
        assert all(r() is None or r() is t for r in alive), f"an earlier tensor is still held at {name}"
        assert t.dtype == torch.bfloat16
        names.append(name)
        alive.append(weakref.ref(t))
        del t
    assert names == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.norm.bias"]
    assert [n for n, _ in serving_weights(m, torch.float32, tied=False)] == [
        "model.embed_tokens.weight", "model.norm.weight", "model.norm.bias"]


def test_tensor_parallel_is_refused_in_one_line():
    with pytest.raises(ValueError) as e:
        VLLMOptions(tensor_parallel_size=2).validate()
    assert "tensor_parallel_size=2" in str(e.value) and "\n" not in str(e.value)


def test_a_sharded_run_on_vllm_keeps_no_generation_copy():
    """With rollout.backend=vllm the trainer builds no second model for rollouts (the engine is
    filled from the shards): build_generation_model returns the trained module itself, where the
    hf backend of a sharded run builds an unsharded copy."""
    from types import SimpleNamespace

    from fastrehearse.train.model_init import build_generation_model
    sharded = SimpleNamespace(sharded=True, device=torch.device("cpu"))
    hf_model = nn.Linear(2, 2)
    cfg = SimpleNamespace(rollout=SimpleNamespace(engine=SimpleNamespace(backend="vllm")), model=SimpleNamespace(precision="fp32"))
    assert build_generation_model(cfg, sharded, policy=None, hf_model=hf_model) is hf_model
