import os

import torch

# No GPU on CPU CI: run Triton kernels through the interpreter. Must be set before triton is
# imported anywhere (triton reads it at kernel launch/JIT time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
