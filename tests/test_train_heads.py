"""The trainer's loss heads (train/heads.py and train/update.py: RL loss, SFT CE, old/ref log-probs) pass the model's
LM-head settings to the kernels, and the RL head's loss and LM-head gradient equal a float64
reference: on a tiny Cohere (logit_scale) and a Qwen2 with an lm_head bias,
the log-probs the trainer computes equal the model's own forward (fp32: 1e-5 plus 8-16 ulps of the
largest |log-prob|, `fp32_atol`; these heads give log-probs of -15 to -40, where a fixed 1e-5 is
2-5 ulps: docs/tolerances.md). The negative control drops the head settings: the bug these tests exist for."""
import pytest
import torch

from _kernel_ref import fp32_atol, max_abs_err
from fastrehearse.data import Episode
from fastrehearse.model import adapter
from fastrehearse.model import RehearsalModel, use_varlen_attention
from fastrehearse.packing import build_packed_batch
from fastrehearse.train.config import TrainConfig
from fastrehearse.train.heads import rl_head, sft_head
from fastrehearse.train.update import compute_logprobs

from test_kernel_model_heads import _eager_reference, _prepare, VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["cohere", "qwen2_bias"])
def test_trainer_heads_use_the_model_head(name, monkeypatch):
    model = _prepare(name)
    ids = torch.randint(3, VOCAB, (25,), generator=torch.Generator().manual_seed(7)).tolist()
    batch = build_packed_batch([Episode(input_ids=ids, roles=[1] * 25, task_id="t")], [0])
    keep = batch.roles != 0
    ref = _eager_reference(model, torch.tensor(ids))
    use_varlen_attention(model)
    wrapped = RehearsalModel(model)
    cfg = TrainConfig()
    lp = compute_logprobs(wrapped, [batch], cfg)[0]
    tol = fp32_atol(ref)
    assert max_abs_err(lp[keep], ref) <= tol
    with monkeypatch.context() as m:    # planted bug: the head's bias / scale not passed on
        m.setattr(adapter, "head_kwargs", lambda model: {})
        bad = compute_logprobs(wrapped, [batch], cfg)[0]
    assert max_abs_err(bad[keep], ref) > 1e-2 > tol

    counts = torch.zeros(4, dtype=torch.float64)
    counts[1] = float(keep.sum())
    cfg.sft.w_act = 1.0
    ce = wrapped(batch, sft_head(cfg, batch, counts))
    assert max_abs_err(ce.logp[keep], ref) <= tol

    # The RL head against a float64 reference: on-policy (old = the current log-probs, ratio 1,
    # nothing clipped) the token-mean loss is -sum_t A_t exp(logp_t - old_t) / n over ACT tokens,
    # with the LM head's gradient -sum_t A_t d logp_t / dW / n.
    adv = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    batch.advantages = adv.clone()
    batch.old_logp = lp.clone()
    batch.ref_logp = None
    w = model.get_output_embeddings().weight
    w.grad = None
    out = wrapped(batch, rl_head(cfg, batch, counts, None))
    out.loss.backward()
    ref_loss, ref_grad, h_max = _rl_reference(model, ids, adv[keep], lp[keep])
    n = int(keep.sum())
    assert abs(float(out.loss) - ref_loss) <= fp32_atol(torch.tensor([ref_loss]), mag=float(adv.abs().max()), terms=n)
    # each gradient element sums n tokens' A_t (onehot - p) h_t / n: terms of size <= 2 max|A| max|h|
    mag = 2 * float(adv.abs().max()) * h_max
    grad_tol = fp32_atol(ref_grad, mag=mag, terms=n)
    # measured: loss 5e-8 / 2e-7, gradient 1.1e-7 / 9.1e-7 off (cohere / qwen2_bias) against ~1.7e-5
    assert max_abs_err(w.grad, ref_grad) <= grad_tol
    w.grad = None                    # planted bug: the advantages' sign flipped
    batch.advantages = -adv
    wrapped(batch, rl_head(cfg, batch, counts, None)).loss.backward()
    assert max_abs_err(w.grad, ref_grad) > 100 * grad_tol


def _rl_reference(model, ids, adv, old):
    """The on-policy RL loss and the LM head's gradient in float64 (a float64 copy of the model)."""
    import copy
    m = copy.deepcopy(model).double()
    m.set_attn_implementation("eager")
    out = m(input_ids=torch.tensor(ids).view(1, -1), use_cache=False, output_hidden_states=True)
    logits = out.logits[0]
    logp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    loss = -(adv.double() * (logp - old.double()).exp()).sum() / len(adv)
    loss.backward()
    return float(loss), m.get_output_embeddings().weight.grad.float(), float(out.hidden_states[-1].abs().max())


def test_triton_fused_kernel_backend():
    """model.kernel_backend='triton-fused': the old / reference log-probs come from the tile kernel
    (Triton interpreter here) and equal the model's own forward; a head it cannot apply (an
    lm_head bias) is refused when the model is known, naming the key."""
    from fastrehearse.train.config import ConfigError
    from fastrehearse.train.build import check_kernel_backend
    cfg = TrainConfig()
    cfg.model.kernel_backend = "triton-fused"
    model = _prepare("cohere")                      # a positive logit scale: folded into 1/T
    check_kernel_backend(cfg, model)
    ids = torch.randint(3, VOCAB, (25,), generator=torch.Generator().manual_seed(7)).tolist()
    batch = build_packed_batch([Episode(input_ids=ids, roles=[1] * 25, task_id="t")], [0])
    keep = batch.roles != 0
    ref = _eager_reference(model, torch.tensor(ids))
    use_varlen_attention(model)
    lp = compute_logprobs(RehearsalModel(model), [batch], cfg)[0]
    assert max_abs_err(lp[keep], ref) <= fp32_atol(ref)
    # the RL loss (a gradient: its sweep runs as "triton") -- the same gradient as with "triton"
    counts = torch.zeros(4, dtype=torch.float64)
    counts[1] = float(keep.sum())
    batch.advantages = torch.linspace(-1, 1, batch.num_tokens)
    batch.old_logp, batch.ref_logp = lp.clone(), None
    grads = {}
    for backend in ("triton", "triton-fused"):
        cfg.model.kernel_backend = backend
        model.zero_grad()
        RehearsalModel(model)(batch, rl_head(cfg, batch, counts, None)).loss.backward()
        grads[backend] = model.get_output_embeddings().weight.grad.clone()
    assert torch.equal(grads["triton"], grads["triton-fused"])
    cfg.model.kernel_backend = "triton-fused"
    with pytest.raises(ConfigError, match=r"'model.kernel_backend' = 'triton-fused'.*LM-head bias"):
        check_kernel_backend(cfg, _prepare("qwen2_bias"))
