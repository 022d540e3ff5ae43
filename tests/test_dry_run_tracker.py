"""The dry run's plan of the smoke model against torch's own memory trackers, on the CPU: the model
built and sharded exactly as the dry run builds it (fake process group, 4 ranks), one real training
step (forward, backward, the trainer's rollback snapshot, AdamW) under FSDPMemTracker.

Tolerances (stated in docs/training.md): parameter shards and AdamW moments exact; the measured
activations and the gathered parameters within 10% of the tracker; the plan's forward/backward peak
an upper bound of the tracker's and at most 2x it (it sums terms that peak at different instants,
and counts the LM-head kernel's workspace at the CPU budget, which the tiny model does not fill:
1.79x in fp32, 1.98x in bf16 with torch 2.13); the optimizer-step moment (rollback copy + foreach
temporaries) within 10% -- the foreach factor (dry_run.ADAMW_FOREACH_SHARDS) was read from this
measurement, so that check holds the rollback copy's 12 bytes per element together with it.
fp32 and bf16 compute (the presets' mixed precision: bf16 gathers, fp32 master and gradients)."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType as Ref
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from fastrehearse.data import Episode
from fastrehearse.kernels._common import FUSED_WORKSPACE_BYTES_CUDA, WORKSPACE_BYTES_CPU
from fastrehearse.model import RehearsalModel
from fastrehearse.packing import build_packed_batch
from fastrehearse.train.config import load_config
from fastrehearse.train.dry_run import plan, resolve_architecture
from fastrehearse.train.heads import sft_head
from fastrehearse.train.model_init import empty_model, materialize
from fastrehearse.train.parallelize import DistInfo, parallelize
from fastrehearse.train.update import _snapshot

pytestmark = pytest.mark.usefixtures("one_thread")
WORLD = 4


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_smoke_plan_matches_fsdp_mem_tracker(precision):
    cfg = load_config("configs/smoke.yaml", [f"rollout.tasks_per_step={WORLD}", f"model.precision={precision}",
                                             "max_tokens=2048", "optim.rollback_nonfinite=true"])
    p = plan(cfg, WORLD)
    item = {i.name.split(" (")[0].split(",")[0]: i.bytes for i in p.items}
    hf_config, _ = resolve_architecture(cfg, None)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        info = DistInfo(0, WORLD, 0, torch.device("cpu"), "fake",
                        init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",)))
        model = parallelize(RehearsalModel(empty_model(hf_config, torch.float32)), info, precision=precision)
        materialize(model, info.device)
        with torch.no_grad():
            for q in model.parameters():
                q.to_local().normal_(0.0, 0.02)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)   # CUDA's default
        t = cfg.max_tokens
        ids = torch.randint(3, hf_config.vocab_size, (t,), generator=torch.Generator().manual_seed(0)).tolist()
        batch = build_packed_batch([Episode(input_ids=ids, roles=[1] * t, task_id="t")], [0])
        counts = torch.zeros(4, dtype=torch.float64)
        counts[1] = t
        cfg.sft.w_act = 1.0

        def fwd_bwd():
            opt.zero_grad(set_to_none=True)
            model(batch, sft_head(cfg, batch, counts)).loss.backward()
        fwd_bwd()
        opt.step()                      # AdamW's moments exist from here on, as in a running job
        tracker = FSDPMemTracker(model, opt)
        with tracker:
            fwd_bwd()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        step_tracker = MemTracker()
        with step_tracker:
            snap = _snapshot(SimpleNamespace(optimizer=opt))
            opt.step()
            del snap
        step_peak = step_tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    finally:
        dist.destroy_process_group()

    assert peak[Ref.SHARDED_PARAM] == item["policy shards"]
    assert peak[Ref.OPT] == pytest.approx(item["AdamW moments"], abs=64 * len(opt.state))   # + step counters
    assert 0.9 <= peak[Ref.ACT] / item["activations"] <= 1.1
    assert 0.9 <= peak[Ref.UNSHARDED_PARAM] / item["gathered params"] <= 1.0
    # the plan's resident training state + its forward/backward moment, the kernel's CPU budget for CUDA's
    planned = (item["policy shards"] + item["gradient shards"] + item["AdamW moments"]
               + p.moment_total("forward/backward") - FUSED_WORKSPACE_BYTES_CUDA + WORKSPACE_BYTES_CPU)
    assert peak["Total"] <= planned <= 2 * peak["Total"], (peak, planned)
    # the optimizer step: what it allocates on top of the state it found (MemTracker counts only
    # the tensors created under it)
    assert 0.9 <= step_peak / p.moment_total("optimizer step") <= 1.1, step_peak
