"""`import fastrehearse.kernels` must pull in torch and triton only (drop-in for other trainers)."""
import subprocess
import sys

CHECK = r"""
import sys
import fastrehearse.kernels as k
assert {"linear_logprobs", "Role"} <= set(k.__all__), k.__all__
banned = ("transformers", "accelerate", "safetensors", "gguf", "fastrehearse.train",
          "fastrehearse.model", "fastrehearse.rollout", "fastrehearse.envs", "fastrehearse.eval",
          "fastrehearse.algo", "fastrehearse.packing", "fastrehearse.data")
bad = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in banned))
print(",".join(bad))
"""


def test_kernels_import_only_torch_and_triton():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"fastrehearse.kernels imported: {out.stdout.strip()}"
