"""From a PackedBatch to final hidden states (never logits), and the nn.Module the trainer shards.

hidden_states() calls the *base* model (e.g. LlamaModel, after its final norm), not the CausalLM
head: the [T, V] logits are the one object an RL step cannot afford, so the LM-head projection is
left to the fused kernels (fastrehearse.kernels.linear_logprobs / linear_policy_loss), which read
the head weight from lm_head_weight().
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fastrehearse.kernels.roles import Role
from fastrehearse.packing.batch import PackedBatch

from .attention import ATTN_IMPL


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack of a transformers CausalLM (the module whose output is after the final norm)."""
    if isinstance(model, RehearsalModel):
        model = model.model
    inner = getattr(model, "base_model", None)
    if inner is None or inner is model:
        # already a base model (e.g. LlamaModel) or an unusual wrapper
        if hasattr(model, "layers") and hasattr(model, "norm"):
            return model
        raise ValueError(f"cannot find the decoder stack of {type(model).__name__}")
    return inner


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The [V, H] LM-head weight (the input embedding when the model ties them).

    Under FSDP2 read it inside the root module's forward (RehearsalModel.forward does), where it is
    the unsharded plain tensor, not a DTensor shard.
    """
    if isinstance(model, RehearsalModel):
        model = model.model
    head = model.get_output_embeddings()
    if head is None:  # tied embeddings without an explicit head module
        head = model.get_input_embeddings()
    w = head.weight
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s LM head has a bias; the fused kernels support weight only")
    return w


def _check_attn(model: nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != ATTN_IMPL:
        raise ValueError(
            f"model uses attention implementation {impl!r}, which does not isolate the episodes of a packed "
            f"row; load it with fastrehearse.model.load_model or call "
            f"fastrehearse.model.use_varlen_attention(model) (sets {ATTN_IMPL!r})")


def varlen_kwargs(batch: PackedBatch, device: torch.device) -> dict[str, Any]:
    cu = batch.cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(batch.max_seqlen),
                max_length_k=int(batch.max_seqlen))


def hidden_states(model: nn.Module, batch: PackedBatch) -> torch.Tensor:
    """[T, H] final hidden states (after the final norm) of a packed row."""
    base = base_model(model)
    _check_attn(base)
    dev = base.get_input_embeddings().weight.device
    if batch.input_ids.dim() != 2 or batch.input_ids.shape[0] != 1:
        raise ValueError(f"batch.input_ids must be [1, T], got {tuple(batch.input_ids.shape)}")
    out = base(input_ids=batch.input_ids.to(dev, non_blocking=True),
               position_ids=batch.position_ids.to(dev, non_blocking=True),
               attention_mask=None, use_cache=False, **varlen_kwargs(batch, dev))
    return out.last_hidden_state[0]


def loss_mask(batch: PackedBatch, *, all_tokens: bool = False) -> torch.Tensor:
    """[T] bool: positions whose target is loss-bearing (role != CONTEXT), or, with all_tokens, every
    position that has a next token inside its episode (all but the last of each episode)."""
    if not all_tokens:
        return batch.roles != Role.CONTEXT
    m = torch.ones(batch.num_tokens, dtype=torch.bool, device=batch.roles.device)
    m[batch.cu_seqlens[1:].to(torch.long) - 1] = False
    return m


def token_logprobs(model: nn.Module, batch: PackedBatch, *, all_tokens: bool = False,
                   backend: str = "auto", temperature: float = 1.0) -> torch.Tensor:
    """[T] float32 log p(targets[t] | tokens <= t of the same episode) via the fused kernel.

    Only loss-bearing positions (target role != CONTEXT) are computed unless all_tokens; the others
    are exactly 0 (they cost no vocabulary projection).
    """
    from fastrehearse.kernels import linear_logprobs
    h = hidden_states(model, batch)
    w = lm_head_weight(model)
    mask = loss_mask(batch, all_tokens=all_tokens).to(h.device)
    logp, _ = linear_logprobs(h, w, batch.targets.to(h.device), mask=mask, temperature=temperature,
                              backend=backend)
    return logp


class RehearsalModel(nn.Module):
    """What the trainer wraps with FSDP2: a transformers CausalLM plus a loss head called inside forward.

        model = RehearsalModel(hf_model)
        for layer in model.layers: fully_shard(layer)
        fully_shard(model)
        out = model(batch, lambda h, w: linear_policy_loss(h, w, ...))

    Inside forward the root FSDP unit's parameters (embedding, final norm, LM head) are gathered,
    so `head_fn` receives the LM-head weight as a plain tensor. With head_fn=None forward returns
    the [T, H] hidden states.
    """

    def __init__(self, hf_model: nn.Module, *, activation_checkpointing: bool = False):
        super().__init__()
        from .attention import use_varlen_attention
        self.model = hf_model
        use_varlen_attention(hf_model)
        if activation_checkpointing:
            self.enable_activation_checkpointing()

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (FSDP2 units, activation-checkpointing units)."""
        return base_model(self.model).layers

    @property
    def config(self):
        return self.model.config

    def enable_activation_checkpointing(self) -> None:
        """Recompute each decoder layer in backward (training mode only).

        Uses transformers' GradientCheckpointingLayer (non-reentrant torch.utils.checkpoint): it
        checkpoints the layer's forward with all keyword arguments, so cu_seq_lens_* reach the
        recomputation too, and it stays inside FSDP2's per-layer hooks.
        """
        kw = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)

    def disable_activation_checkpointing(self) -> None:
        if hasattr(self.model, "activation_checkpointing_disable"):
            self.model.activation_checkpointing_disable()
        else:
            self.model.gradient_checkpointing_disable()

    @property
    def activation_checkpointing(self) -> bool:
        return any(getattr(layer, "gradient_checkpointing", False) for layer in self.layers)

    def lm_head_weight(self) -> torch.Tensor:
        return lm_head_weight(self.model)

    def forward(self, batch: PackedBatch,
                head_fn: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> Any:
        h = hidden_states(self.model, batch)
        if head_fn is None:
            return h
        return head_fn(h, lm_head_weight(self.model))
