import os

import pytest
import torch
from hypothesis import settings

# Property tests draw a fixed example set by default, so a CI run is reproducible: a failure seen
# once is seen every time, and an unlucky draw never turns CI red at random.
# HYPOTHESIS_PROFILE=explore draws fresh examples (run it when touching the kernels).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# A tensor on the wrong device reaching a collective fails the tests instead of being moved (and
# warned about) as in a user's run; inherited by the torchrun workers the tests start.
os.environ.setdefault("FASTREHEARSE_STRICT_COLLECTIVES", "1")

# No GPU on CPU CI: run Triton kernels through the interpreter. Must be set before triton is
# imported anywhere (triton reads it at kernel launch/JIT time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny GEMMs on a 2-core box shared by many jobs are 10-100x slower with an OpenMP pool
    spinning on busy cores; modules of small-tensor tests opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
