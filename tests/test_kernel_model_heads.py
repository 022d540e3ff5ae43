"""fastrehearse.model reads the LM-head settings of real transformers classes (Gemma2's and
Gemma3's final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling, an lm_head
bias) and the kernels then reproduce the model's own logits' log_softmax (fp32: 1e-5 plus 8-16 ulps of
the largest |log-prob|, `fp32_atol`: these heads make log-probs of -35 to -90, where 1e-5 is 1-3 ulps
and fails under other summation orders: docs/tolerances.md); heads it cannot express are refused when the
model is wrapped, naming the setting. Every tolerance has a negative control: the bug it exists
for (the setting dropped, attention leaking across the packed episodes) exceeds it."""
import dataclasses
import random

import pytest
import torch
from torch import nn

from _kernel_ref import fp32_atol, max_abs_err
from fastrehearse.data import Episode
from fastrehearse.kernels import linear_logprobs
from fastrehearse.model import lm_head
from fastrehearse.model import (RehearsalModel, build_tiny_model, check_lm_head, head_kwargs,
                                lm_head_weight, token_logprobs, use_varlen_attention)
from fastrehearse.packing import build_packed_batch

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gemma2(**kw):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(**COMMON, final_logit_softcapping=kw.pop("cap", 3.0),
                       attn_logit_softcapping=kw.pop("attn_cap", None),
                       layer_types=["full_attention"] * 2, **kw)
    return Gemma2ForCausalLM(cfg)


def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, final_logit_softcapping=3.0,
                                              attn_logit_softcapping=None,
                                              layer_types=["full_attention"] * 2))


def tiny_cohere():
    from transformers import CohereConfig, CohereForCausalLM
    return CohereForCausalLM(CohereConfig(**COMMON, logit_scale=0.25))


def tiny_granite():
    from transformers import GraniteConfig, GraniteForCausalLM
    return GraniteForCausalLM(GraniteConfig(**COMMON, logits_scaling=4.0))


def tiny_qwen2_bias():
    model = build_tiny_model("qwen2", vocab_size=VOCAB, seed=0)
    old = model.lm_head
    model.lm_head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(old.weight)
        model.lm_head.bias.normal_(0.0, 2.0)
    return model


MODELS = {"gemma2": (tiny_gemma2, {"logit_softcap": 3.0}),
          "gemma3_text": (tiny_gemma3, {"logit_softcap": 3.0}),
          "cohere": (tiny_cohere, {"logit_scale": 0.25}),
          "granite": (tiny_granite, {"logit_scale": 0.25}),
          "qwen2_bias": (tiny_qwen2_bias, {"bias"})}


def _prepare(name):
    torch.manual_seed(0)
    model = MODELS[name][0]().float().eval()
    with torch.no_grad():   # logits of order 10: a soft-cap of 3 / a scale of 0.25 matter a lot
        model.get_output_embeddings().weight.normal_(0.0, 1.0)
    return model


def _eager_reference(model, ids):
    """log p(ids[t+1] | ids[:t+1]) from the model's own forward (its own head code), float64 softmax."""
    model.set_attn_implementation("eager")
    with torch.no_grad():
        logits = model(input_ids=ids.view(1, -1), use_cache=False).logits[0].double()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_reproduce_model_logits(name, backend):
    model = _prepare(name)
    kw = head_kwargs(model)
    expected = MODELS[name][1]
    assert (set(kw) == expected if isinstance(expected, set) else kw == expected), kw
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    ref = _eager_reference(model, ids)
    with torch.no_grad():
        h = model.model(input_ids=ids.view(1, -1), use_cache=False).last_hidden_state[0]
        w = model.get_output_embeddings().weight
        lp, _ = linear_logprobs(h[:-1], w, ids[1:], backend=backend, **kw)
        plain, _ = linear_logprobs(h[:-1], w, ids[1:], backend=backend)
    assert max_abs_err(lp, ref) <= fp32_atol(ref)
    assert max_abs_err(plain, ref) > 1e-2 > fp32_atol(ref)   # the setting really matters here


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_token_logprobs_and_rehearsal_model_use_the_head(name):
    """The adapter's own paths (token_logprobs, RehearsalModel.forward with a head_fn taking
    **head) on a packed row of two episodes == each episode through the model's own forward."""
    model = _prepare(name)
    rng = random.Random(2)
    eps = [Episode(input_ids=[rng.randrange(3, VOCAB) for _ in range(n)],
                   roles=[rng.choice([0, 1, 2, 3]) for _ in range(n)], task_id=f"t{i}")
           for i, n in enumerate((17, 23))]
    batch = build_packed_batch(eps, [0, 1])
    ref = torch.cat([_eager_reference(model, torch.tensor(e.input_ids)) for e in eps])
    keep = torch.ones(batch.num_tokens, dtype=torch.bool)
    keep[batch.cu_seqlens[1:].long() - 1] = False        # last token of each episode: no target
    tol = fp32_atol(ref)
    use_varlen_attention(model)
    # negative control, a planted bug: the row's document boundaries lost (one document), so
    # episode 2 attends to episode 1 -- what this test exists to catch
    leaky = dataclasses.replace(batch, cu_seqlens=batch.cu_seqlens[[0, -1]],
                                max_seqlen=batch.num_tokens)
    with torch.no_grad():
        leaked = token_logprobs(model, leaky, all_tokens=True, backend="torch")
    assert max_abs_err(leaked[keep], ref) > 1e-2 > tol
    with torch.no_grad():
        lp = token_logprobs(model, batch, all_tokens=True, backend="torch")
    assert max_abs_err(lp[keep], ref) <= tol
    wrapped = RehearsalModel(model)
    with torch.no_grad():
        lp2 = wrapped(batch, lambda h, w, **head: linear_logprobs(
            h, w, batch.targets, mask=keep, backend="torch", **head)[0])
    assert max_abs_err(lp2[keep], ref) <= tol


def test_bias_gradient_through_rehearsal_model_matches_model_forward():
    model = _prepare("qwen2_bias")
    ids = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(4))
    model.set_attn_implementation("eager")
    logits = model(input_ids=ids.view(1, -1), use_cache=False).logits[0]
    torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None]).sum().backward()
    ref_db = model.lm_head.bias.grad.clone()
    model.zero_grad()
    wrapped = RehearsalModel(model)
    batch = build_packed_batch([Episode(input_ids=ids.tolist(), roles=[1] * 30, task_id="t")], [0])
    keep = torch.ones(30, dtype=torch.bool)
    keep[-1] = False
    out = wrapped(batch, lambda h, w, **head: linear_logprobs(h, w, batch.targets, mask=keep,
                                                              backend="torch", **head)[0].sum())
    out.backward()
    assert torch.allclose(model.lm_head.bias.grad, ref_db, atol=1e-5, rtol=1e-5)


def test_inexpressible_heads_refused_naming_the_setting():
    gemma = tiny_gemma2(attn_cap=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        RehearsalModel(gemma)
    llama = build_tiny_model("llama", vocab_size=VOCAB, seed=0)
    llama.config.logit_scale = 2.0          # a head key on a model type we do not know it for
    with pytest.raises(ValueError, match="logit_scale=2.0"):
        check_lm_head(llama)
    llama.config.logit_scale = 1.0          # neutral values are fine
    check_lm_head(llama)
    cohere = _prepare("cohere")
    use_varlen_attention(cohere)
    wrapped = RehearsalModel(cohere)
    batch = build_packed_batch([Episode(input_ids=[5, 6, 7], roles=[1, 1, 1], task_id="t")], [0])
    with pytest.raises(ValueError, match=r"logit_scale=0.25.*does not accept the keyword"):
        wrapped(batch, lambda h, w: linear_logprobs(h, w, batch.targets)[0])
    with pytest.raises(ValueError, match="not just a weight"):
        lm_head_weight(cohere)


# The one head spec (fastrehearse.model.lm_head), family by family: a tiny random model of every
# model type it lists, with a non-neutral head setting, against the model's own logits.
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
CAP = {"final_logit_softcapping": 3.0}
SPEC_MODELS = {   # model_type: (config overrides, head_settings expected)
    "cohere": ({"logit_scale": 0.25}, {"logit_scale": 0.25}),
    "cohere2": ({"logit_scale": 0.25}, {"logit_scale": 0.25}),
    "cohere2_moe": ({"logit_scale": 0.25}, {"logit_scale": 0.25}),
    "granite": ({"logits_scaling": 4.0}, {"logit_scale": 0.25}),
    "granitemoe": ({"logits_scaling": 4.0}, {"logit_scale": 0.25}),
    "granitemoeshared": ({"logits_scaling": 4.0}, {"logit_scale": 0.25}),
    "granitemoehybrid": ({"logits_scaling": 4.0, "mamba_n_heads": 4, "mamba_d_head": 16,
                          "shared_intermediate_size": 64}, {"logit_scale": 0.25}),
    "granite_swa": ({"logits_scaling": 4.0}, {"logit_scale": 0.25}),
    "granitemoe_swa": ({"logits_scaling": 4.0}, {"logit_scale": 0.25}),
    "hyperclovax": ({"logits_scaling": 4.0}, {"logit_scale": 4.0}),          # multiplies
    "falcon_h1": ({"lm_head_multiplier": 0.25}, {"logit_scale": 0.25}),
    "minicpm3": ({"dim_model_base": 8, "num_key_value_heads": 4, "qk_nope_head_dim": 8,   # 32/8
                  "qk_rope_head_dim": 8, "v_head_dim": 8, "q_lora_rank": 16, "kv_lora_rank": 16},
                 {"logit_scale": 0.25}),
    "gemma2": (CAP, {"logit_softcap": 3.0}),
    "gemma3_text": (CAP, {"logit_softcap": 3.0}),
    "vaultgemma": (CAP, {"logit_softcap": 3.0}),
    "nanochat": (CAP, {"logit_softcap": 3.0}),
    "beam": (CAP, {"logit_softcap": 3.0}),
    "recurrent_gemma": ({"logits_soft_cap": 3.0, "lru_width": 32}, {"logit_softcap": 3.0}),
}


def spec_model(mtype):
    """A tiny random model of `mtype` whose head setting moves its logits a lot (head ~ N(0, 1))."""
    from transformers import AutoConfig, AutoModelForCausalLM
    over = SPEC_MODELS[mtype][0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mtype, **{**SMALL, **over}))
    model = model.float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 1.0)
    return model


def test_head_spec_lists_exactly_the_tested_families():
    assert set(lm_head.HEAD_RULES) == set(SPEC_MODELS)


@pytest.mark.parametrize("mtype", list(SPEC_MODELS))
def test_head_spec_reproduces_each_family_logits(mtype):
    """The spec's head_kwargs of every family in the spec: the kernels on the base model's
    hidden states == log_softmax of the model's own forward (its own head code). Falcon-H1
    (lm_head_multiplier), HyperCLOVA X (logits_scaling multiplies) and MiniCPM3 (hidden states
    divided before the head) were refused by the trainer while the TRL adapter scored them."""
    model = spec_model(mtype)
    kw = lm_head.head_kwargs(model)    # the spec (the trainer adds its attention checks on top)
    assert kw == SPEC_MODELS[mtype][1]
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].double()
        h = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0]
        w = model.get_output_embeddings().weight
        lp, _ = linear_logprobs(h[:-1], w, ids[0, 1:], backend="torch", **kw)
        plain, _ = linear_logprobs(h[:-1], w, ids[0, 1:], backend="torch")
    ref = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    assert max_abs_err(lp, ref) <= fp32_atol(ref)
    assert max_abs_err(plain, ref) > 1e-2 > fp32_atol(ref)   # the setting really matters
