"""TRL adapter against TRL 1.16's own GRPOTrainer on tiny random models (real trl, CPU).

Same seed, same initial weights: the per-token log-probs / entropies must agree to 1e-5 plus
8-16 ulps of the largest |log-prob| (`fp32_atol`: 1e-5 alone is 1.3 ulp at Cohere's -75) and every
parameter gradient of 3 training steps must agree (TRL's chunked head vs fastrehearse's head, and
TRL's loss vs the fused loss). Gemma2 (final logit soft-capping) and Cohere (logit scale) must be
scored correctly or refused, never silently wrong.
"""
import copy
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from _kernel_ref import fp32_atol  # noqa: E402
from fastrehearse.integrations import trl as fr_trl  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = [f"w{i}" for i in range(60)]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


def tiny_model(kind="llama", seed=0, head_std=0.5, **over):
    torch.manual_seed(seed)
    common = dict(vocab_size=63 + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, eos_token_id=1, bos_token_id=None)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, **over)
        cls = transformers.LlamaForCausalLM
    elif kind == "gemma2":
        cfg = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=2.0,
                                        query_pre_attn_scalar=8, sliding_window=16, **over)
        cls = transformers.Gemma2ForCausalLM
    elif kind == "cohere":
        cfg = transformers.CohereConfig(**common, logit_scale=3.5, **over)
        cls = transformers.CohereForCausalLM
    elif kind == "qwen3_moe":   # router aux loss on by default (router_aux_loss_coef 0.001)
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=16,
                                          num_experts=4, num_experts_per_tok=2, **over)
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "gpt_oss":
        cfg = transformers.GptOssConfig(**common, head_dim=8, num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=16, **over)
        cls = transformers.GptOssForCausalLM
    else:
        raise ValueError(kind)
    model = cls(cfg).float()
    with torch.no_grad():  # a random head with visible logits, so transforms matter
        model.get_output_embeddings().weight.normal_(0.0, head_std)
    return model


def prompts_dataset(n=8):
    from datasets import Dataset
    g = torch.Generator().manual_seed(1)
    rows = [" ".join(WORDS[int(i)] for i in torch.randint(0, 60, (5,), generator=g))
            for _ in range(n)]
    return Dataset.from_dict({"prompt": rows})


def reward_w7(completions, **kw):
    # deterministic, varies across completions so advantages are non-zero
    return [float(sum((i + 1) * int(w[1:]) for i, w in enumerate(c.split()) if w[1:].isdigit())
                  % 11) for c in completions]


def grpo_args(tmp_path, **over):
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=3,
              per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
              logging_steps=1, save_strategy="no", seed=7, learning_rate=1e-2,
              # plain SGD: Adam's m / sqrt(v) turns fp32 rounding in near-zero gradients into
              # +-lr parameter differences, which later steps' gradients would then reflect
              optim="sgd",
              max_grad_norm=0.0, bf16=False, disable_dropout=True, temperature=0.9)
    kw.update(over)
    return trl.GRPOConfig(**kw)


class GradRecorder(transformers.TrainerCallback):
    def __init__(self):
        self.model, self.grads = None, []

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters()
                           if p.grad is not None})


def train(cls, model, tmp_path, extra=None, **over):
    args = grpo_args(tmp_path, **over)
    tok = tiny_tokenizer()
    rec = GradRecorder()
    trainer = cls(model=model, args=args, reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                  processing_class=tok, callbacks=[rec], **(extra or {}))
    rec.model = trainer.model
    trainer.train()
    return trainer, rec.grads


# Global gradient-norm ratio, every step. Not 1e-6: an Intel Xeon (AVX-512 MKL / ATen kernels)
# gives 1.09e-6 and 1.14e-6 for two correct runs (docs/tolerances.md), the fp32 noise of two
# differently ordered backward passes. 1e-5 is the element check's own bound
# (a global scale error s shows in every element as s * max|g|, so it fails both at s > 1e-5),
# ~9x the worst correct gap seen. The smallest bug these tests exist to catch (an entropy bonus
# of 0.05 dropped or sign-flipped) moves the norm by > 1e-3:
# test_planted_entropy_sign_bug_fails_the_grad_check runs it.
NORM_REL = 1e-5


def assert_grads_equal(ga, gb, rel=1e-5, later_rel=None):
    """Every element within rel * max|grad| of its tensor (fp32 sums in another order: an
    elementwise relative test is meaningless for near-zero elements), and the global gradient
    norms within NORM_REL relative. `later_rel[k]` replaces `rel` at step k >= 1 (later steps
    start from parameters that already differ by the previous steps' rounding; see
    `trl_sensitivity`)."""
    assert len(ga) == len(gb) and len(ga) > 0
    # non-trivial gradients (non-zero advantages), else equality would say nothing
    assert all(max(float(g.abs().max()) for g in step.values()) > 1e-3 for step in ga)
    for step, (a, b) in enumerate(zip(ga, gb)):
        assert a.keys() == b.keys()
        tol_el = rel if step == 0 or later_rel is None else max(rel, later_rel[step])
        for n in a:
            scale = float(a[n].abs().max())
            torch.testing.assert_close(b[n], a[n], rtol=0, atol=tol_el * scale,
                                       msg=lambda m: f"step {step} grad {n}: {m}")
        norm = lambda g: torch.linalg.vector_norm(torch.stack(  # noqa: E731
            [torch.linalg.vector_norm(t.double()) for t in g.values()]))
        gap = abs(float(norm(b) / norm(a)) - 1.0)
        assert gap < NORM_REL, f"step {step} grad norm: |ratio - 1| = {gap:.3g} >= {NORM_REL}"


def batch_inputs():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 63, (3, 12), generator=g)
    attn = torch.ones_like(ids)
    attn[1, :2] = 0            # left padding of a prompt
    attn[2, -3:] = 0           # padding after the end of a completion
    return ids, attn


def batch_logps(trainer, model):
    ids, attn = batch_inputs()
    return trainer._get_per_token_logps_and_entropies(model, ids, attn, 6, compute_entropy=True)


def test_llama_logps_and_entropy_match_trl_head(tmp_path):
    base = tiny_model("llama")
    ref_tr = trl.GRPOTrainer(model=copy.deepcopy(base), args=grpo_args(tmp_path / "a"),
                             reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                             processing_class=tiny_tokenizer())
    fast = fr_trl.FastGRPOTrainer(model=copy.deepcopy(base), args=grpo_args(tmp_path / "b"),
                                  reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                                  processing_class=tiny_tokenizer())
    lp_a, ent_a, _ = batch_logps(ref_tr, ref_tr.model)
    lp_b, ent_b, _ = batch_logps(fast, fast.model)
    assert lp_a.shape == lp_b.shape == (3, 6)
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=fp32_atol(lp_a))
    torch.testing.assert_close(ent_b, ent_a, rtol=0, atol=fp32_atol(lp_a))  # |z| ~ |logp| sets it
    assert (lp_b[2, -3:] == 0).all() and (lp_a[2, -3:] == 0).all()  # padded completion tokens
    assert (lp_b[:2] != 0).all()


@pytest.mark.parametrize("fused_loss", [False, True])
def test_llama_grpo_steps_match_trl(tmp_path, fused_loss):
    base = tiny_model("llama")
    _, g_ref = train(trl.GRPOTrainer, copy.deepcopy(base), tmp_path / "ref")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the fused path must not fall back here
        fast, g_fast = train(fr_trl.FastGRPOTrainer, copy.deepcopy(base), tmp_path / "fast",
                             extra={"fused_loss": fused_loss})
    assert len(g_ref) == 3
    assert_grads_equal(g_ref, g_fast)
    assert fast.fused_loss_calls == (3 if fused_loss else 0)
    logs = [h for h in fast.state.log_history if "entropy" in h]
    assert len(logs) == 3 and all(h["clip_ratio/region_mean"] == 0.0 for h in logs)


@pytest.mark.parametrize("over", [
    dict(loss_type="bnpo", beta=0.05, use_bias_correction_kl=False),
    dict(loss_type="grpo", beta=0.05, num_iterations=2),       # KL x ratio (TRL's default)
    dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2),  # GSPO
    dict(loss_type="grpo", importance_sampling_level="sequence"),    # GSPO on-policy
    dict(loss_type="cispo", epsilon_high=1.1, num_iterations=2),
    dict(loss_type="dr_grpo", epsilon_high=0.28),
    dict(loss_type="dapo", num_iterations=2, delta=1.5),   # off-policy second pass: real ratios
    dict(loss_type="bnpo", entropy_coef=0.01),
])
def test_fused_loss_types_match_trl(tmp_path, over):
    # beta != 0: TRL builds the reference model from the policy's path, so pass a saved model
    path = str(tmp_path / "model")
    tiny_model("llama", seed=1).save_pretrained(path)
    _, g_ref = train(trl.GRPOTrainer, path, tmp_path / "ref", **over)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        fast, g_fast = train(fr_trl.FastGRPOTrainer, path, tmp_path / "fast", **over)
    try:
        assert_grads_equal(g_ref, g_fast)
    except AssertionError:   # later steps: no closer than TRL is to itself (measured only when needed)
        assert_grads_equal(g_ref, g_fast, later_rel=trl_sensitivity(g_ref, tmp_path, over))
    assert fast.fused_loss_calls >= 3


def grad_gaps(ga, gb) -> list[float]:
    """Per step: the largest |b - a| of any element over its tensor's max |a|."""
    return [max(float((b[n] - a[n]).abs().max()) / max(float(a[n].abs().max()), 1e-30) for n in a)
            for a, b in zip(ga, gb)]


def trl_sensitivity(g_ref, tmp_path, over, runs=3) -> list[float]:
    """Twice the largest step-k gap between TRL and TRL itself started from weights perturbed by
    ~1 ulp (relative 6e-8 noise), over `runs` perturbations. With lr 1e-2 the trajectories amplify
    rounding: for bnpo + entropy_coef 0.01 a 1-ulp start gives TRL vs TRL gaps of 1.8e-5 / 1.9e-5
    at step 2 (2 of 3 seeds), above the fixed 1e-5; a kernel that rounds differently (e.g. more
    exactly, as the off-target target entry does) can land there too. Step 0 stays strict."""
    worst = [0.0] * len(g_ref)
    for k in range(runs):
        path = str(tmp_path / f"model_ulp{k}")
        m = tiny_model("llama", seed=1)
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1 + 6e-8 * torch.randn(p.shape, generator=g))
        m.save_pretrained(path)
        _, g_p = train(trl.GRPOTrainer, path, tmp_path / f"ulp{k}", **over)
        worst = [max(w, x) for w, x in zip(worst, grad_gaps(g_ref, g_p))]
    return [2 * w for w in worst]


def loss_batch(seed=1, b=4, p=5, c=7, vocab=63):
    """A hand-made micro-batch for _compute_loss: completions of different lengths (so
    per-sequence and per-token normalizers differ), a tool mask, left-padded prompts."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :2] = 0
    lengths = torch.tensor([c, 3, 5, 1][:b])
    completion_mask = (torch.arange(c) < lengths[:, None]).long()
    tool_mask = torch.ones(b, c, dtype=torch.long)
    tool_mask[2, 1:3] = 0                           # tool output inside a completion
    adv = torch.randn(b, generator=g)
    return {"prompt_ids": torch.randint(3, vocab, (b, p), generator=g), "prompt_mask": prompt_mask,
            "completion_ids": torch.randint(3, vocab, (b, c), generator=g),
            "completion_mask": completion_mask, "tool_mask": tool_mask, "advantages": adv,
            "num_items_in_batch": (completion_mask * tool_mask).sum() * 2}


def compare_compute_loss(tmp_path, over, off_policy, fused=True, beta=0.04, attrs=None,
                         is_ratio=False, check=True):
    """TRL's _compute_loss vs FastGRPOTrainer's on loss_batch(): loss value and every gradient
    (gradient accumulation 2, by default beta 0.04 with a KL x ratio term). `attrs` are set on
    both trainers (e.g. use_vllm without starting vLLM); `is_ratio` adds a vLLM importance
    ratio per token."""
    base = tiny_model("llama", seed=4)
    over = dict(gradient_accumulation_steps=2, epsilon=0.1, max_completion_length=7, **over)
    out = {}
    for name, cls in (("trl", trl.GRPOTrainer), ("fast", fr_trl.FastGRPOTrainer)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = cls(model=copy.deepcopy(base), args=grpo_args(tmp_path / name, **over),
                     reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                     processing_class=tiny_tokenizer())
        tr.current_gradient_accumulation_steps = 2     # set by train(); _compute_loss reads it
        tr.beta = beta                                 # the KL term (TRL would also build a ref model)
        for k, v in (attrs or {}).items():
            setattr(tr, k, v)
        inputs = loss_batch()
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            lp, _, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, attn, 7)
        g = torch.Generator().manual_seed(9)
        inputs["ref_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
        if off_policy:
            inputs["old_per_token_logps"] = lp + 0.2 * torch.randn(lp.shape, generator=g)
        if is_ratio:
            inputs["importance_sampling_ratio"] = 0.5 + torch.rand(lp.shape, generator=g)
        fr_trl._warned.clear()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always", UserWarning)
            loss = tr._compute_loss(tr.model, inputs)
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad.clone() for n, p in tr.model.named_parameters()
                                     if p.grad is not None})
        if name == "fast":
            assert tr.fused_loss_calls == int(fused)
            fallbacks = [w for w in rec if "TRL's own loss" in str(w.message)]
            assert len(fallbacks) == int(not fused), [str(w.message) for w in rec]
    if not check:
        return out
    torch.testing.assert_close(out["fast"][0], out["trl"][0], rtol=1e-5, atol=1e-7)
    assert_grads_equal([out["trl"][1]], [out["fast"][1]])


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("off_policy", [False, True])
def test_loss_normalizers_match_trl_on_uneven_batch(tmp_path, loss_type, level, off_policy):
    """Uneven completion lengths and a tool mask: per-sequence and per-token normalizers differ."""
    compare_compute_loss(tmp_path, dict(loss_type=loss_type, importance_sampling_level=level,
                                        epsilon_high=1.5 if loss_type == "cispo" else 0.28),
                         off_policy)


@pytest.mark.parametrize("beta,entropy_coef", [(0.0, 0.0), (0.04, 0.0), (0.04, 0.05)])
@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_vllm_importance_ratio_fused_with_kl_and_entropy(tmp_path, loss_type, beta, entropy_coef):
    """TRL's vLLM importance-sampling correction (on by default with use_vllm) scales the policy
    term per token and leaves the KL term and entropy bonus unscaled: the kernel's pg_weights do
    exactly that, so the loss stays fused with beta != 0 and an entropy bonus too (the adapter does
    not fall back to TRL's own loss)."""
    compare_compute_loss(tmp_path, dict(loss_type=loss_type, entropy_coef=entropy_coef), True,
                         True, beta=beta,
                         attrs={"use_vllm": True, "vllm_importance_sampling_correction": True},
                         is_ratio=True)


def test_vllm_importance_ratio_on_grpo_with_kl(tmp_path):
    """grpo (per-sequence normalizer) with the vLLM ratio and a KL term: fused too."""
    compare_compute_loss(tmp_path, dict(loss_type="grpo"), True, True, beta=0.04,
                         attrs={"use_vllm": True, "vllm_importance_sampling_correction": True},
                         is_ratio=True)


@pytest.mark.parametrize("loss_type,fused", [("bnpo", True), ("dapo", True), ("grpo", False)])
def test_entropy_bonus_fused_where_expressible(tmp_path, loss_type, fused):
    """TRL weights the entropy bonus per token; grpo weights the policy term per sequence, so
    with uneven lengths grpo + entropy bonus falls back (one warning), the others are fused."""
    compare_compute_loss(tmp_path, dict(loss_type=loss_type, entropy_coef=0.05), True, fused)


def grad_norm_gap(ga: dict, gb: dict) -> float:
    norm = lambda g: torch.linalg.vector_norm(torch.stack(  # noqa: E731
        [torch.linalg.vector_norm(t.double()) for t in g.values()]))
    return abs(float(norm(gb) / norm(ga)) - 1.0)


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_planted_entropy_bonus_bug_fails_the_grad_check(tmp_path, monkeypatch, loss_type):
    """NORM_REL (1e-5) and the element check still catch the smallest bug the entropy-bonus
    tests exist for: the fused loss dropping the 0.05 bonus (its coefficient zeroed) moves the
    global gradient norm by far more than NORM_REL, and assert_grads_equal fails."""
    mixin = fr_trl._FastGRPOMixin
    real = mixin._fused_compute_loss
    monkeypatch.setattr(mixin, "_fused_compute_loss",
                        lambda self, model, inputs, mask, tw, ent_coef, mode, *rest:
                        real(self, model, inputs, mask, tw, 0.0, mode, *rest))
    out = compare_compute_loss(tmp_path, dict(loss_type=loss_type, entropy_coef=0.05), True,
                               check=False)
    gap = grad_norm_gap(out["trl"][1], out["fast"][1])
    assert gap > 20 * NORM_REL, gap
    with pytest.raises(AssertionError, match="step 0 grad"):
        assert_grads_equal([out["trl"][1]], [out["fast"][1]])


def test_unsupported_loss_falls_back_with_one_warning(tmp_path):
    base = tiny_model("llama", seed=2)
    _, g_ref = train(trl.GRPOTrainer, copy.deepcopy(base), tmp_path / "ref", loss_type="sapo")
    fr_trl._warned.clear()
    with pytest.warns(UserWarning, match="loss_type='sapo'") as rec:
        _, g_fast = train(fr_trl.FastGRPOTrainer, copy.deepcopy(base), tmp_path / "fast",
                          loss_type="sapo")
    assert sum("sapo" in str(w.message) for w in rec) == 1
    assert_grads_equal(g_ref, g_fast)


@pytest.mark.parametrize("kind", ["gemma2", "cohere"])
def test_softcap_and_logit_scale_models_scored_or_refused(tmp_path, kind):
    base = tiny_model(kind)
    ref_tr = trl.GRPOTrainer(model=copy.deepcopy(base), args=grpo_args(tmp_path / "a"),
                             reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                             processing_class=tiny_tokenizer())
    lp_a, ent_a, _ = batch_logps(ref_tr, ref_tr.model)
    fast = fr_trl.FastGRPOTrainer(model=copy.deepcopy(base), args=grpo_args(tmp_path / "b"),
                                  reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                                  processing_class=tiny_tokenizer())
    tr = fast.head_transform
    assert (tr.logit_softcap, tr.logit_scale) == ((2.0, None) if kind == "gemma2" else (None, 3.5))
    lp_b, ent_b, _ = batch_logps(fast, fast.model)
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=fp32_atol(lp_a))
    torch.testing.assert_close(ent_b, ent_a, rtol=0, atol=fp32_atol(lp_a))  # |z| ~ |logp| sets it
    # and TRL's own head is right: against float64 logits of the model's own (unpatched) forward
    ids, attn = batch_inputs()
    with torch.no_grad():
        z = base(input_ids=ids, attention_mask=attn).logits[:, -7:-1].double() / 0.9
    ref = torch.log_softmax(z, -1).gather(-1, ids[:, -6:, None]).squeeze(-1)
    on = attn[:, -6:].bool()
    torch.testing.assert_close(lp_b.double()[on], ref[on], rtol=0, atol=fp32_atol(ref[on]))
    # negative control: the head's soft-cap / logit scale dropped is far outside that tolerance
    with torch.no_grad():
        h = base.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, -7:-1]
        zp = h.double() @ base.get_output_embeddings().weight.double().t() / 0.9
    plain = torch.log_softmax(zp, -1).gather(-1, ids[:, -6:, None]).squeeze(-1)
    assert float((plain - ref)[on].abs().max()) > 1e-2 > fp32_atol(ref[on])


@pytest.mark.parametrize("kind", ["gemma2", "cohere"])
def test_softcap_and_logit_scale_fused_training_matches_trl(tmp_path, kind):
    # a head scale that keeps sampling diverse (Cohere ties the head to the embeddings)
    base = tiny_model(kind, seed=3, head_std=0.5 if kind == "gemma2" else 0.02)
    _, g_ref = train(trl.GRPOTrainer, copy.deepcopy(base), tmp_path / "ref")
    fast, g_fast = train(fr_trl.FastGRPOTrainer, copy.deepcopy(base), tmp_path / "fast")
    assert_grads_equal(g_ref, g_fast)
    assert fast.fused_loss_calls == 3


def test_unknown_head_transform_is_refused():
    model = tiny_model("llama")
    orig = model.forward

    def doubled(*a, **k):  # a custom forward that rescales logits, announced by no config field
        out = orig(*a, **k)
        out.logits = out.logits * 2.0
        return out

    model.forward = doubled
    with pytest.raises(fr_trl.UnsupportedModelError, match="differ"):
        fr_trl.patch_fused_lm_head(model)


def test_head_with_bias_is_scored_or_refused():
    model = tiny_model("llama")
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    model.lm_head.weight = head.weight
    with torch.no_grad():
        model.lm_head.bias.normal_(0.0, 2.0)
    ids = torch.randint(3, 63, (2, 9))
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids).logits[:, :-1].double(), -1)
        ref = ref.gather(-1, ids[:, 1:, None]).squeeze(-1)
    fr_trl.patch_fused_lm_head(model)
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    torch.testing.assert_close(out.log_probs.double(), ref, rtol=0, atol=fp32_atol(ref))


def test_entropy_metric_off_gives_same_gradients(tmp_path):
    base = tiny_model("llama", seed=5)
    fast_a, g_a = train(fr_trl.FastGRPOTrainer, copy.deepcopy(base), tmp_path / "a")
    fast_b, g_b = train(fr_trl.FastGRPOTrainer, copy.deepcopy(base), tmp_path / "b",
                        extra={"entropy_metric": False})
    assert_grads_equal(g_a, g_b)
    assert all("entropy" in h for h in fast_a.state.log_history if "loss" in h)
    assert not any("entropy" in h for h in fast_b.state.log_history)


def _softcapped_forward(model):
    """`model` with an unannounced soft-cap in a custom forward: the head check must see it."""
    orig = model.forward

    def capped(*a, **k):
        out = orig(*a, **k)
        out.logits = 30.0 * torch.tanh(out.logits / 30.0)
        return out

    model.forward = capped
    return model


def test_head_check_in_bfloat16():
    """bf16 models: the head check neither refuses a correctly described head (Gemma2 softcap)
    nor accepts an unannounced softcap (a custom forward applying one)."""
    fr_trl.patch_fused_lm_head(tiny_model("gemma2", head_std=2.0).to(torch.bfloat16))
    model = _softcapped_forward(tiny_model("llama", head_std=2.0).to(torch.bfloat16))
    with pytest.raises(fr_trl.UnsupportedModelError, match="differ"):
        fr_trl.patch_fused_lm_head(model)


def test_autocast_hidden_dtype_differs_from_head():
    """A bf16 model with an fp32 head (what TRL's cast_lm_head_to_fp32 makes), under bf16
    autocast: bf16 hidden states, fp32 weight. The head runs outside autocast at the weight's
    precision, exactly (against float64)."""
    model = tiny_model("llama").to(torch.bfloat16)
    head = model.lm_head = model.lm_head.float()           # as GRPOTrainer's cast does
    head.forward = lambda h: torch.nn.functional.linear(h.float(), head.weight, head.bias)
    fr_trl.patch_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    ids = torch.randint(3, 63, (2, 9))
    labels = ids.clone()
    labels[0, :4] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        h = model.model(input_ids=ids).last_hidden_state[:, :-1]
    assert h.dtype == torch.bfloat16 and out.log_probs.dtype == torch.float32
    z = h.double() @ model.lm_head.weight.double().t() / 0.8
    ref = torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    on = labels[:, 1:] != -100
    torch.testing.assert_close(out.log_probs.double()[on], ref[on], rtol=0, atol=fp32_atol(ref[on]))
    assert (out.log_probs[~on] == 0).all() and (out.entropy[~on] == 0).all()
    out.log_probs.sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.float32
    assert model.model.norm.weight.grad.dtype == torch.bfloat16


# ---- TRL's defaults: bf16 autocast with a reference model --------------------------------------


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """beta != 0: TRL builds the reference model from the policy's path, so pass a saved model."""
    path = str(tmp_path_factory.mktemp("llama") / "model")
    tiny_model("llama", seed=1).save_pretrained(path)
    return path


def test_trl_defaults_bf16_autocast_with_reference_model_train(tmp_path, saved_llama):
    """bf16=True (TRL's default on GPUs) and beta > 0: TRL wraps the reference model's forward in
    bf16 autocast before the adapter patches it. The head check judges it like with like (it was
    refused: bf16 logits against an fp32 reference at an fp32 tolerance), the reference
    log-probs equal TRL's own fp32 head on the same autocast backbone, and 3 fused steps train."""
    over = dict(bf16=True, beta=0.04)
    fast = fr_trl.FastGRPOTrainer(model=saved_llama, args=grpo_args(tmp_path / "f", **over),
                                  reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                                  processing_class=tiny_tokenizer())
    ref_tr = trl.GRPOTrainer(model=saved_llama, args=grpo_args(tmp_path / "t", **over,
                                                               cast_lm_head_to_fp32=True),
                             reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                             processing_class=tiny_tokenizer())
    ids, attn = batch_inputs()
    lp_a, _, _ = ref_tr._get_per_token_logps_and_entropies(ref_tr.ref_model, ids, attn, 6)
    lp_b, _, _ = fast._get_per_token_logps_and_entropies(fast.ref_model, ids, attn, 6)
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=fp32_atol(lp_a))
    fast.train()
    assert fast.fused_loss_calls == 3
    kls = [h["kl"] for h in fast.state.log_history if "kl" in h]
    # policy == reference at step 0; the KL grows once the policy moves
    assert len(kls) == 3 and abs(kls[0]) < 1e-6 and 0.0 < kls[1] < 10.0 and 0.0 < kls[2] < 10.0


def test_head_check_like_with_like_under_autocast():
    """Policy and reference get the same check whatever wraps their forward: accelerate's bf16
    autocast wrapper (what TRL puts on the reference model) is accepted for a plain head and a
    Gemma2 soft-cap, and a custom forward's unannounced soft-cap is still refused under it."""
    from accelerate import Accelerator
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    for kind in ("llama", "gemma2"):
        model = acc.prepare_model(tiny_model(kind, head_std=2.0), evaluation_mode=True)
        fr_trl.patch_fused_lm_head(model)
    model = _softcapped_forward(tiny_model("llama", head_std=2.0))
    model = acc.prepare_model(model, evaluation_mode=True)
    with pytest.raises(fr_trl.UnsupportedModelError, match="differ"):
        fr_trl.patch_fused_lm_head(model)


# ---- MoE: the router aux loss, fused and through TRL's loss -------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "trl_loss"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_moe_router_aux_loss_matches_trl(tmp_path, kind, fused):
    """TRL 1.16 turns the MoE load-balancing loss on by default. The fused loss adds it itself
    (the router logits of the same forward), and the fallback (TRL's loss on fastrehearse
    log-probs) gets it from the patched forward: both match TRL's gradients and aux_loss metric."""
    base = tiny_model(kind, seed=2)
    ref_tr, g_ref = train(trl.GRPOTrainer, copy.deepcopy(base), tmp_path / "ref")
    assert ref_tr.aux_loss_enabled
    aux_ref = [h["aux_loss"] for h in ref_tr.state.log_history if "aux_loss" in h]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # no fallback warning on the fused path
        fast, g_fast = train(fr_trl.FastGRPOTrainer, copy.deepcopy(base), tmp_path / "fast",
                             extra={"fused_loss": fused})
    assert fast.fused_loss_calls == (3 if fused else 0)
    assert_grads_equal(g_ref, g_fast)
    aux = [h["aux_loss"] for h in fast.state.log_history if "aux_loss" in h]
    assert len(aux) == 3 and aux == pytest.approx(aux_ref, rel=1e-5)


# ---- PEFT / LoRA policies ------------------------------------------------------------------------


def lora_config(**over):
    peft = pytest.importorskip("peft")
    kw = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
              task_type="CAUSAL_LM", init_lora_weights=False)   # non-zero B: the adapter matters
    kw.update(over)
    return peft.LoraConfig(**kw)


@pytest.mark.parametrize("head", ["frozen", "modules_to_save"])
def test_lora_policy_with_disabled_adapter_reference_matches_trl(tmp_path, saved_llama, head):
    """A LoRA policy (base weights frozen), beta > 0: the reference log-probs come from the same
    model with the adapter disabled, as TRL does. The LM head either stays frozen outside the
    adapter or is trained whole through modules_to_save=['lm_head'] (PEFT wraps it; the reference
    pass runs the original head). Same gradients of every trainable parameter as TRL, fused."""
    over = {"modules_to_save": ["lm_head"]} if head == "modules_to_save" else {}
    extra = {"peft_config": lora_config(**over)}
    ref_tr, g_ref = train(trl.GRPOTrainer, saved_llama, tmp_path / "ref", extra=extra, beta=0.04)
    fast, g_fast = train(fr_trl.FastGRPOTrainer, saved_llama, tmp_path / "fast",
                         extra={**extra, "fused_loss": True}, beta=0.04)
    assert fast.ref_model is None and fast.fused_loss_calls == 3
    names = set(g_fast[0])
    assert names and all("lora_" in n or "modules_to_save" in n for n in names)
    assert any("modules_to_save" in n for n in names) == (head == "modules_to_save")
    assert_grads_equal(g_ref, g_fast)
    kls = [h["kl"] for h in fast.state.log_history if "kl" in h]
    # the non-zero LoRA init makes the policy differ from the (disabled-adapter) reference at once
    assert len(kls) == 3 and kls[0] > 1e-4


def test_lora_on_lm_head_is_refused_by_name(tmp_path):
    """A LoRA adapter on lm_head: refused (TRL's GRPOTrainer refuses it as well, before us)."""
    peft = pytest.importorskip("peft")
    with pytest.raises(ValueError, match="lm_head"):
        fr_trl.FastGRPOTrainer(model=tiny_model("llama"), args=grpo_args(tmp_path),
                               reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                               processing_class=tiny_tokenizer(),
                               peft_config=lora_config(target_modules=["q_proj", "lm_head"]))
    wrapped = peft.get_peft_model(tiny_model("llama"),
                                  lora_config(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(fr_trl.UnsupportedModelError, match="LoRA adapter"):
        fr_trl.patch_fused_lm_head(wrapped.get_base_model())


# ---- one head spec for the trainer and the TRL adapter -------------------------------------------


@pytest.mark.parametrize("mtype", sorted(__import__("test_kernel_model_heads").SPEC_MODELS))
def test_trainer_and_trl_adapter_read_one_head_spec(mtype):
    """fastrehearse.model.head_kwargs (the trainer) and head_transform (the TRL adapter) agree on
    every family of the spec, and the TRL head check accepts each against the model's own forward.
    They disagreed before (lm_head_multiplier: Falcon-H1 refused by the trainer, multiplied by the
    adapter; HyperCLOVA X's and MiniCPM3's logits_scaling likewise)."""
    from test_kernel_model_heads import spec_model

    from fastrehearse.model import head_kwargs
    model = spec_model(mtype)
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        model.config.attn_logit_softcapping = None   # the trainer's packed attention lacks it
    kw = head_kwargs(model)
    tr = fr_trl.head_transform(model)
    assert (tr.logit_scale, tr.logit_softcap) == (kw.get("logit_scale"), kw.get("logit_softcap"))
    assert tr.has_bias == ("bias" in kw)
    fr_trl.verify_head(model, tr)


def test_head_check_refuses_a_wrong_spec():
    """The head check is what catches a spec entry that is wrong for a model: Falcon-H1 read
    without its lm_head_multiplier (TRL's and the trainer's disagreement, one side wrong)."""
    from test_kernel_model_heads import spec_model
    model = spec_model("falcon_h1")
    tr = fr_trl.head_transform(model)
    fr_trl.verify_head(model, tr)
    with pytest.raises(fr_trl.UnsupportedModelError, match="differ"):
        fr_trl.verify_head(model, fr_trl.HeadTransform(tr.has_bias, tr.logit_softcap, None))


# ---- the settings table: generated from the rules the code runs ----------------------------------


def test_settings_table_in_docs_is_generated_from_the_rules():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    assert fr_trl.settings_table() in doc, (
        "docs/integrations.md is out of date: paste the output of python -c 'from "
        "fastrehearse.integrations.trl import settings_table; print(settings_table())'")


@pytest.mark.parametrize("rule", [r for r in fr_trl.RULES if r.example],
                         ids=lambda r: r.setting.split(" (")[0])
def test_each_rule_example_takes_its_path(tmp_path, saved_llama, rule):
    """Each table row with example settings, on a real FastGRPOTrainer built with them: a fused
    row passes every fallback rule, a fallback row is the first rule that applies."""
    from fastrehearse.integrations.trl_rules import FALLBACK, FUSED
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = fr_trl.FastGRPOTrainer(model=saved_llama, args=grpo_args(tmp_path, **rule.example),
                                    reward_funcs=reward_w7, train_dataset=prompts_dataset(),
                                    processing_class=tiny_tokenizer())
    why = tr._fused_loss_blocker({})
    assert rule.path in (FUSED, FALLBACK)
    if rule.path == FUSED:
        assert why is None
    else:
        assert why is not None and why.endswith(rule.why)
        assert why.startswith(rule.name(tr) if rule.name else rule.setting)


@pytest.mark.parametrize("version,ok", [("1.16.0", True), ("1.16.3", True), ("1.16.0.dev0", True),
                                        ("1.15.2", False), ("1.17.0", False), ("2.0.0", False)])
def test_trl_outside_the_tested_range_is_refused_in_one_line(version, ok):
    """The adapter overrides GRPOTrainer's private methods: another TRL release is refused, naming
    the installed version and the range to install, instead of training silently wrong."""
    if ok:
        fr_trl.check_trl_version(version)
        return
    with pytest.raises(fr_trl.UnsupportedTRLError) as e:
        fr_trl.check_trl_version(version)
    assert "\n" not in str(e.value) and f"trl {version} is installed" in str(e.value)
    assert "pip install 'trl>=1.16,<1.17'" in str(e.value)
    assert fr_trl.check_trl_version(trl.__version__) is None   # the installed one is in range
