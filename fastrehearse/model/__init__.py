"""Model side: load_model(spec) -> (model, tokenizer); packed varlen forward to hidden states only.

    model, tok = load_model("smollm2")              # or a HF dir, a .gguf, "tiny-llama", ...
    h = hidden_states(model, batch)                 # [T, H], after the final norm
    logp = token_logprobs(model, batch)             # [T] float32 via the fused kernel
    head = head_kwargs(model)                       # bias / logit_scale / logit_softcap, {} if plain
    wrapped = RehearsalModel(model)                 # what the trainer shards with FSDP2
"""
from .adapter import (RehearsalModel, base_model, check_lm_head, head_kwargs, head_settings, hidden_states,
                      lm_head_weight, loss_mask, token_logprobs, varlen_kwargs)
from .attention import ATTN_IMPL, available_backends, register, use_varlen_attention
from .loader import (EMBEDDED_SPECS, TINY_FAMILIES, build_tiny_model, embedded_gguf_path, load_model,
                     load_tokenizer, tiny_config)

register()  # make ATTN_IMPL known to transformers as soon as fastrehearse.model is imported

__all__ = ["load_model", "load_tokenizer", "build_tiny_model", "tiny_config", "embedded_gguf_path",
           "hidden_states", "token_logprobs", "lm_head_weight", "head_kwargs", "head_settings",
           "check_lm_head", "loss_mask", "base_model",
           "varlen_kwargs", "RehearsalModel", "ATTN_IMPL", "register", "use_varlen_attention",
           "available_backends", "EMBEDDED_SPECS", "TINY_FAMILIES"]
