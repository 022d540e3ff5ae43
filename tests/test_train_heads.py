"""The trainer's loss heads (train/loop.py: RL loss, SFT CE, old/ref log-probs) pass the model's
LM-head settings to the kernels: on a tiny Cohere (logit_scale) and a Qwen2 with an lm_head bias,
the log-probs the trainer computes equal the model's own forward (fp32, 1e-5)."""
import pytest
import torch

from fastrehearse.data import Episode
from fastrehearse.model import RehearsalModel, use_varlen_attention
from fastrehearse.packing import build_packed_batch
from fastrehearse.train.config import TrainConfig
from fastrehearse.train.loop import _rl_head, _sft_head, compute_logprobs

from test_kernel_model_heads import _eager_reference, _prepare, VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["cohere", "qwen2_bias"])
def test_trainer_heads_use_the_model_head(name):
    model = _prepare(name)
    ids = torch.randint(3, VOCAB, (25,), generator=torch.Generator().manual_seed(7)).tolist()
    batch = build_packed_batch([Episode(input_ids=ids, roles=[1] * 25, task_id="t")], [0])
    keep = batch.roles != 0
    ref = _eager_reference(model, torch.tensor(ids))
    use_varlen_attention(model)
    wrapped = RehearsalModel(model)
    cfg = TrainConfig()
    lp = compute_logprobs(wrapped, [batch], cfg)[0]
    assert float((lp[keep].double() - ref).abs().max()) <= 1e-5

    counts = torch.zeros(4, dtype=torch.float64)
    counts[1] = float(keep.sum())
    cfg.sft.w_act = 1.0
    ce = wrapped(batch, _sft_head(cfg, batch, counts))
    assert float((ce.logp[keep].double() - ref).abs().max()) <= 1e-5

    batch.advantages = torch.ones(batch.num_tokens)
    batch.old_logp = lp.clone()
    batch.ref_logp = None
    out = wrapped(batch, _rl_head(cfg, batch, counts, None))
    out.loss.backward()     # on-policy ratio 1: loss = -mean(A) over ACT tokens, gradient flows
    assert torch.isfinite(out.loss)
    assert model.get_output_embeddings().weight.grad is not None
