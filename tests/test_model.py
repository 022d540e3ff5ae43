"""Packed varlen forward == each episode run alone, for tiny Llama / Qwen2 / Qwen3 (fp32, CPU).

The reference runs every episode by itself through transformers' own "eager" attention (no padding,
no packing), materializes the logits and takes log_softmax; the packed path goes through our
registered attention and the fused log-prob kernel, never building logits.
"""
import copy
import random

import pytest
import torch

from fastrehearse.data import Episode
from fastrehearse.kernels.roles import Role
from fastrehearse.model import (ATTN_IMPL, RehearsalModel, build_tiny_model, hidden_states, lm_head_weight,
                                load_model, loss_mask, token_logprobs)
from fastrehearse.packing import build_packed_batch, pack

VOCAB = 512
FAMILIES = ["llama", "qwen2", "qwen3"]


def tiny(family, seed=0):
    # initializer_range 0.1 (not 0.02) so attention is far from uniform and a leak across
    # documents is large (see test_boundaries_matter)
    return build_tiny_model(family, vocab_size=VOCAB, seed=seed, initializer_range=0.1)


def random_episodes(rng, lengths):
    return [Episode(input_ids=[rng.randrange(VOCAB) for _ in range(n)],
                    roles=[rng.choice([0, 1, 1, 2, 3]) for _ in range(n)], task_id=f"t{i}")
            for i, n in enumerate(lengths)]


def reference_logprobs(ref_model, ep):
    """[n-1] log p(token t+1 | tokens <= t) of one episode run alone through eager attention."""
    ids = torch.tensor([ep.input_ids])
    logits = ref_model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]


def eager_copy(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref


ROWS = [[1], [300], [2, 1, 57], [5, 1, 120, 33, 260, 7, 1, 90]]  # 1..8 episodes, lengths 1..300


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logprobs_match_unpacked(family):
    model = tiny(family)
    ref = eager_copy(model)
    rng = random.Random(hash(family) % 1000)
    with torch.no_grad():
        for lengths in ROWS + [[rng.randint(1, 300) for _ in range(rng.randint(1, 8))]]:
            eps = random_episodes(rng, lengths)
            batch = build_packed_batch(eps, list(range(len(eps))))
            logp = token_logprobs(model, batch, all_tokens=True, backend="torch")
            assert logp.dtype == torch.float32 and logp.shape == (batch.num_tokens,)
            cu = batch.cu_seqlens.tolist()
            for k, ep in enumerate(eps):
                s, e = cu[k], cu[k + 1]
                want = reference_logprobs(ref, ep)
                torch.testing.assert_close(logp[s:e - 1], want, rtol=0, atol=1e-5)
                assert logp[e - 1].item() == 0.0  # episode end: no target
            # Only loss-bearing roles by default; CONTEXT targets cost nothing and read exactly 0.
            logp_roles = token_logprobs(model, batch, backend="torch")
            m = batch.roles != Role.CONTEXT
            torch.testing.assert_close(logp_roles[m], logp[m], rtol=0, atol=1e-6)
            assert (logp_roles[~m] == 0).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_match_unpacked(family):
    model = tiny(family, seed=1)
    ref = eager_copy(model)
    eps = random_episodes(random.Random(5), [40, 1, 77, 3])
    batch = pack(eps, 1024)[0]
    with torch.no_grad():
        h = hidden_states(model, batch)
        assert h.shape == (batch.num_tokens, model.config.hidden_size)
        cu = batch.cu_seqlens.tolist()
        for k, idx in enumerate(batch.episode_indices):
            want = ref.model(input_ids=torch.tensor([eps[idx].input_ids])).last_hidden_state[0]
            torch.testing.assert_close(h[cu[k]:cu[k + 1]], want, rtol=0, atol=1e-5)


def test_boundaries_matter():
    """Negative control: the same row treated as one document differs clearly, so the equality
    above is not vacuous."""
    model = tiny("llama")
    eps = random_episodes(random.Random(6), [50, 60])
    batch = build_packed_batch(eps, [0, 1])
    leaky = copy.copy(batch)
    leaky.cu_seqlens = torch.tensor([0, batch.num_tokens], dtype=torch.int32)
    leaky.max_seqlen = batch.num_tokens
    with torch.no_grad():
        a = token_logprobs(model, batch, all_tokens=True, backend="torch")
        b = token_logprobs(model, leaky, all_tokens=True, backend="torch")
    torch.testing.assert_close(a[:49], b[:49], rtol=0, atol=1e-5)  # earlier tokens never see later ones
    assert (a[50:109] - b[50:109]).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_gradients_equal_sum_of_episode_gradients(family):
    model = tiny(family, seed=2)
    ref = eager_copy(model)
    rng = random.Random(7)
    eps = random_episodes(rng, [23, 1, 140, 64, 9])
    batch = build_packed_batch(eps, list(range(len(eps))))
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(0))
    # packed: sum_t w_t * logp_t over loss-bearing positions
    logp = token_logprobs(model, batch, backend="torch")
    (weights * logp).sum().backward()
    # unpacked: the same sum, one episode at a time
    m = loss_mask(batch)
    cu = batch.cu_seqlens.tolist()
    for k, ep in enumerate(eps):
        s, e = cu[k], cu[k + 1]
        if len(ep) > 1:
            lp = reference_logprobs(ref, ep)
            (weights[s:e - 1] * m[s:e - 1] * lp).sum().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, g_ref = p.grad, ref_grads[name].grad
        assert g is not None and g_ref is not None, name
        rel = ((g - g_ref).norm() / g_ref.norm().clamp_min(1e-30)).item()
        assert rel < 1e-5, (name, rel)


def test_activation_checkpointing_same_gradients(monkeypatch):
    import fastrehearse.model.attention as attn
    calls = []
    per_doc = attn._sdpa_per_document
    monkeypatch.setattr(attn, "_sdpa_per_document", lambda *a: calls.append(1) or per_doc(*a))
    eps = random_episodes(random.Random(8), [30, 45, 1, 12])
    batch = build_packed_batch(eps, [0, 1, 2, 3])
    grads = []
    for ac in (False, True):
        model = RehearsalModel(tiny("qwen3", seed=3), activation_checkpointing=ac).train()
        assert model.activation_checkpointing == ac
        calls.clear()
        h = model(batch)
        (h.pow(2).mean()).backward()
        # with checkpointing each layer's varlen attention runs again in backward, boundaries included
        assert len(calls) == (4 if ac else 2)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-6, atol=1e-7)


def test_rehearsal_model_calls_head_inside_forward():
    hf = tiny("llama")
    model = RehearsalModel(hf)
    assert len(model.layers) == 2 and model.layers is hf.model.layers
    batch = build_packed_batch(random_episodes(random.Random(9), [4, 6]), [0, 1])
    seen = {}

    def head(h, w):
        seen["w"] = w
        return h.sum() + w.sum()

    out = model(batch, head)
    assert seen["w"] is lm_head_weight(hf) is hf.model.embed_tokens.weight  # tied embeddings
    assert torch.allclose(out, hidden_states(hf, batch).sum() + seen["w"].sum())
    untied = tiny("qwen2")
    assert lm_head_weight(untied) is untied.lm_head.weight


def test_unpacked_generation_path_still_works():
    """With a padding mask (batched generation) the registered attention defers to SDPA."""
    model = tiny("qwen2")
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=0, atol=1e-5)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert out.shape == (2, 12)


def test_errors():
    model = tiny("llama")
    batch = build_packed_batch(random_episodes(random.Random(10), [5, 6]), [0, 1])
    # a packed row without explicit boundaries would leak: refused, not silently wrong
    with pytest.raises(ValueError, match="position_ids restart inside the row"):
        model.model(input_ids=batch.input_ids, position_ids=batch.position_ids)
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=f"attention implementation 'sdpa'.*{ATTN_IMPL}"):
        hidden_states(sdpa, batch)
    with pytest.raises(FileNotFoundError, match=r"model path '/no/such/model_dir' does not exist"):
        load_model("/no/such/model_dir")
    with pytest.raises(ValueError, match="unknown tiny model 'tiny-gpt2'"):
        load_model("tiny-gpt2")
    with pytest.raises(ValueError, match="dtype must be"):
        load_model("tiny-llama", dtype="float64x")


def test_load_tiny_and_hf_dir_roundtrip(tmp_path):
    model, tok = load_model("tiny-llama", seed=4)
    assert model.config.vocab_size == len(tok) and model.config._attn_implementation == ATTN_IMPL
    assert "<|im_start|>" in tok.chat_template
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    again, tok2 = load_model(str(tmp_path))
    assert again.config._attn_implementation == ATTN_IMPL and len(tok2) == len(tok)
    ids = tok("hello world, call a tool")["input_ids"]
    batch = build_packed_batch([Episode(ids, [1] * len(ids), "x")], [0])
    with torch.no_grad():
        torch.testing.assert_close(hidden_states(again, batch), hidden_states(model, batch), rtol=0, atol=0)


@pytest.mark.slow
def test_smollm2_gguf_packed_equals_unpacked():
    model, tok = load_model("smollm2")
    ref = eager_copy(model)
    texts = ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
             "<|im_start|>user\nList the files.<|im_end|>\n<|im_start|>assistant\n"
             '<tool_call>{"name": "ls", "arguments": {}}</tool_call><|im_end|>']
    eps = [Episode(ids, [1] * len(ids), f"s{i}") for i, ids in enumerate(tok(texts)["input_ids"])]
    batch = build_packed_batch(eps, [0, 1])
    with torch.no_grad():
        logp = token_logprobs(model, batch, all_tokens=True, backend="torch")
        cu = batch.cu_seqlens.tolist()
        for k, ep in enumerate(eps):
            # 30 fp32 layers: eager-vs-SDPA rounding measured at ~2e-5 on log-probs down to -14;
            # a leak across the two episodes would be ~1e-1.
            torch.testing.assert_close(logp[cu[k]:cu[k + 1] - 1], reference_logprobs(ref, ep), rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA varlen kernels need a GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_varlen_backends_match_per_document_sdpa(family, monkeypatch):
    """On CUDA, each available varlen kernel (flash-attn, torch varlen_attn) against SDPA run per
    document, same bf16 model, forward and backward. (Not run on the CPU CI.)"""
    from fastrehearse.model import available_backends
    model = tiny(family).to("cuda", torch.bfloat16)
    batch = build_packed_batch(random_episodes(random.Random(11), [5, 1, 120, 33, 260, 7]), list(range(6)))
    batch = batch.to("cuda")
    results = {}
    for backend in available_backends("cuda", torch.bfloat16):
        monkeypatch.setenv("FASTREHEARSE_ATTN_BACKEND", backend)
        model.zero_grad()
        h = hidden_states(model, batch)
        h.float().pow(2).mean().backward()
        results[backend] = (h.detach().float(), model.model.layers[0].self_attn.q_proj.weight.grad.float())
    h_ref, g_ref = results.pop("sdpa")
    assert results, "no CUDA varlen backend available (torch.nn.attention.varlen missing?)"
    for backend, (h, g) in results.items():
        torch.testing.assert_close(h, h_ref, rtol=0, atol=5e-2, msg=backend)
        assert ((g - g_ref).norm() / g_ref.norm()).item() < 5e-2, backend
