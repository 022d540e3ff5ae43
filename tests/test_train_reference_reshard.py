"""A no-grad forward of an FSDP2 model (old log-probs, the KL reference) leaves it sharded: the root is
wrapped with reshard_after_forward=False and, with no backward to reshard it, its gathered embeddings
and LM head would otherwise stay on every rank through the update (2.3 GiB at 8B)."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fastrehearse.data import Episode
from fastrehearse.model import RehearsalModel
from fastrehearse.packing import build_packed_batch
from fastrehearse.train.config import load_config
from fastrehearse.train.dry_run import resolve_architecture
from fastrehearse.train.model_init import empty_model, materialize
from fastrehearse.train.parallelize import DistInfo, parallelize
from fastrehearse.train.update import compute_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def one_rank_gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistInfo(0, 1, 0, torch.device("cpu"), "gloo", init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    finally:
        dist.destroy_process_group()


def _root_params(model):
    """The parameters FSDP2's root group owns (embeddings, final norm, LM head): not in a layer."""
    return [(n, p) for n, p in model.named_parameters() if ".layers." not in n]


@pytest.mark.parametrize("frozen", [False, True], ids=["policy", "reference"])
def test_root_is_sharded_again_after_a_no_grad_forward(one_rank_gloo, frozen):
    cfg = load_config("configs/smoke.yaml", ["model.precision=fp32"])
    hf_config, _ = resolve_architecture(cfg, None)
    model = parallelize(RehearsalModel(empty_model(hf_config, torch.float32)), one_rank_gloo, precision="fp32")
    materialize(model, one_rank_gloo.device)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    model.requires_grad_(not frozen)
    ids = torch.randint(3, hf_config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    batch = build_packed_batch([Episode(input_ids=ids, roles=[1] * 40, task_id="t")], [0])
    assert all(isinstance(p, DTensor) for _, p in _root_params(model))
    lp = compute_logprobs(model, [batch], cfg)[0]
    assert torch.isfinite(lp).all() and (lp[batch.roles != 0] < 0).all()
    unsharded = [n for n, p in _root_params(model) if not isinstance(p, DTensor)]
    assert not unsharded, f"left unsharded after the forward: {unsharded}"
