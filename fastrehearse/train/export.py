"""Export the trained model as a Hugging Face directory (safetensors + config + tokenizer).

The result loads with `AutoModelForCausalLM.from_pretrained(dir)` / `AutoTokenizer.from_pretrained
(dir)`, with no fastrehearse import needed. Sharded (FSDP2) parameters are gathered first.
It is written to `<dir>.tmp` and renamed, so a kill or a full disk never leaves a half export.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from .checkpoint import full_model_state_dict
from .errors import disk_full_guard
from .parallelize import DistInfo, barrier


def _strip(sd: dict, prefix: str) -> dict:
    # checkpoint_wrapper (activation checkpointing) inserts this into parameter names.
    sd = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in sd.items()}
    if not prefix:
        return sd
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def hf_prefix(root: nn.Module, hf_model: nn.Module) -> str:
    """Name prefix of hf_model's parameters inside root ('' when root is hf_model)."""
    if root is hf_model:
        return ""
    for name, mod in root.named_modules():
        if mod is hf_model:
            return name + "."
    raise ValueError("hf_model is not a submodule of the trained module")


def export_hf(root: nn.Module, hf_model: nn.Module, tokenizer, out_dir: str | Path, info: DistInfo,
              dtype: torch.dtype | None = None) -> Path:
    """Collective. Rank 0 writes `out_dir`; returns it."""
    out = Path(out_dir)
    sd = _strip(full_model_state_dict(root), hf_prefix(root, hf_model))
    if info.is_main:
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        try:
            with disk_full_guard(tmp, keeping="the checkpoints are kept; free space and rerun with --resume"):
                # Tied embeddings: lm_head.weight and embed_tokens.weight are one tensor;
                # save_pretrained drops the duplicate per the config's tie_word_embeddings.
                hf_model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    barrier(info)
    return out
