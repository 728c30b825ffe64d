# The README's commands. `make demo` runs the main job, `make test` the test suite.
PYTHON ?= python
# torch first, pinned, so that pip takes the local CPU wheel instead of resolving a multi-GB CUDA build.
# Elsewhere: TORCH_SPEC="torch" (or install the torch for your CUDA yourself and run `make install-package`).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install install-package demo test test-main test-compat test-llama-cpp test-transformers-common bench gpu-check

install:
	@# An environment made without pip (`uv venv`, some conda envs) gets it from the standard library first.
	@$(PYTHON) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m ensurepip --upgrade >/dev/null
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(MAKE) install-package

install-package:
	$(PYTHON) -m pip install -q -e ".[dev]"

demo: install
	$(PYTHON) scripts/demo.py --output_dir runs/demo

# Three legs: the suite under the installed transformers 5.x, again under 5.17, then the model files under 4.57
# (each other release in its own cached venv that shares the installed torch).
test: test-main test-compat

test-main:
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests -q

test-compat:
	PYTHON=$(PYTHON) bash .ci/compat.sh 5.17
	PYTHON=$(PYTHON) bash .ci/compat.sh 4.57

# llama.cpp runs our GGUF export and must agree with MiniMind token for token. llama-cpp-python compiles
# llama.cpp from source (6-13 minutes on 2 cores, cached by pip afterwards), so this leg is separate from `test`.
test-llama-cpp:
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(PYTHON) -m pip install -q "llama-cpp-python==0.3.36"
	MINIMIND_LLAMA_CPP=1 HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests/test_export.py -q -k llama_cpp

# transformers' own common model tests (ModelTesterMixin & co.) on MiniMind, Qwen3 alongside. They are fetched from
# the installed transformers' sdist on PyPI at test time (never copied here); 40 s on a quiet 2-core machine, up to 6 minutes on a busy one.
test-transformers-common:
	PYTHON=$(PYTHON) bash .ci/transformers-common.sh

bench:
	$(PYTHON) scripts/benchmark.py

# Everything that needs a CUDA GPU (tests, benchmark, profiles) in one run of at most ~8 minutes; not part of CI.
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh
