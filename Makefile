# The README's commands. `make demo` runs the main job, `make test` the test suite.
PYTHON ?= python
# torch first, pinned, so that pip takes the local CPU wheel instead of resolving a multi-GB CUDA build.
# Elsewhere: TORCH_SPEC="torch" (or install the torch for your CUDA yourself and run `make install-package`).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install install-package demo lint test test-main test-compat test-llama-cpp test-transformers-common bench gpu-check

install:
	@# An environment made without pip (`uv venv`, some conda envs) gets it from the standard library first.
	@$(PYTHON) -m pip --version >/dev/null 2>&1 || $(PYTHON) -m ensurepip --upgrade >/dev/null
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(MAKE) install-package

install-package:
	$(PYTHON) -m pip install -q -e ".[dev]"

demo: install
	$(PYTHON) scripts/demo.py --output_dir runs/demo

# The suite runs in PYTEST_WORKERS processes (pytest-xdist; 0: one process), one test module per worker at a time,
# so each module's fixtures are built once; most tests are single-threaded Python, so two workers on 2 cores take
# about two thirds of one's time. The workers' order is the collection's (tests/conftest.py puts the longest first).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Three legs: the suite under the installed transformers 5.x, again under 5.17, then the model files under 4.57
# (each other release in its own cached venv that shares the installed torch).
test: lint test-main test-compat

# ruff's lint rules and format (settings in pyproject.toml); `ruff format .` fixes the format.
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test-main:
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests -q $(PYTEST_PARALLEL)

test-compat:
	PYTHON=$(PYTHON) PYTEST_PARALLEL="$(PYTEST_PARALLEL)" bash .ci/compat.sh 5.17
	PYTHON=$(PYTHON) bash .ci/compat.sh 4.57

# llama.cpp runs our GGUF export and must agree with MiniMind token for token. llama-cpp-python compiles
# llama.cpp from source (6-13 minutes on 2 cores, cached by pip afterwards), so this leg is separate from `test`.
test-llama-cpp:
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(PYTHON) -m pip install -q "llama-cpp-python==0.3.36"
	MINIMIND_LLAMA_CPP=1 HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests/export/test_export.py tests/export/test_gguf_types.py -q -k llama

# transformers' own common model tests (ModelTesterMixin & co.) on MiniMind, Qwen3 alongside. They are fetched from
# the installed transformers' sdist on PyPI at test time (never copied here); 40 s on a quiet 2-core machine, up to 6 minutes on a busy one.
test-transformers-common:
	PYTHON=$(PYTHON) bash .ci/transformers-common.sh

# The measurement lab (bench/, not installed): the main table against Qwen3 into docs/results.md.
bench:
	$(PYTHON) -m bench

# Everything that needs a CUDA GPU (tests, benchmark, profiles) in one run of at most ~8 minutes; not part of CI.
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh

# Mutation testing with mutmut 3.8 (`pip install mutmut==3.8.1`; its settings and test selection are in setup.cfg).
# It runs in a snapshot of the working tree under .cache/mutmut, so the scores describe the code at the start of the
# run whatever is edited meanwhile, and mutants/ never lands in the checkout. MUTATE_SAMPLE mutants per module are
# drawn at random with MUTATE_SEED (0: every mutant, hours on 2 cores); `mutmut results` in .cache/mutmut lists the
# survivors and `mutmut show NAME` shows one. docs/testing.md has the scores.
MUTATE_MODULES ?= data/validate data/pretrain data/sft data/collate data/store data/cache data/prepare training/arguments training/model training/saving training/checkpoints training/trainers \
	training/curves training/recipes export chat
MUTATE_SAMPLE ?= 30
MUTATE_SEED ?= 20261130
MUTATE_JOBS ?= 1
MUTATE_DIR := .cache/mutmut

.PHONY: mutate
mutate:
	rm -rf $(MUTATE_DIR) && mkdir -p $(MUTATE_DIR)
	git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -T - -cf - | tar -xf - -C $(MUTATE_DIR)
	@# mutmut asks git which files changed since its last run; a one-commit repository says "all of them".
	cd $(MUTATE_DIR) && git init -q && git add -A && git -c user.name=mutmut -c user.email=mutmut@localhost commit -qm snapshot
	@# Generating the mutants first (mutmut's own steps) gives the names the sample is drawn from.
	cd $(MUTATE_DIR) && $(PYTHON) -c "import json, random, sys, mutmut.__main__ as m; \
	m.copy_src_dir(); m.copy_also_copy_files(); m.setup_source_paths(); m.store_lines_covered_by_tests(); \
	m.create_mutants(2); rng = random.Random($(MUTATE_SEED)); names = []; \
	[names.extend((lambda keys: keys if $(MUTATE_SAMPLE) <= 0 else rng.sample(keys, min($(MUTATE_SAMPLE), len(keys))))( \
	sorted(json.load(open(f'mutants/minimind/{mod}.py.meta'))['exit_code_by_key']))) for mod in '$(MUTATE_MODULES)'.split()]; \
	open('mutant-names.txt', 'w').write('\n'.join(names))"
	cd $(MUTATE_DIR) && HF_HUB_OFFLINE=1 $(PYTHON) -m mutmut run --max-children $(MUTATE_JOBS) $$(cat mutant-names.txt)
	@# Per module: killed (a test failed), timeout (counted as killed), survived, no test reached the function.
	@cd $(MUTATE_DIR) && $(PYTHON) -c "import json, collections; \
	names = open('mutant-names.txt').read().split(); codes = {}; \
	[codes.update(json.load(open(f'mutants/minimind/{mod}.py.meta'))['exit_code_by_key']) for mod in '$(MUTATE_MODULES)'.split()]; \
	kind = lambda c: {1: 'killed', 0: 'survived', 33: 'no tests', None: 'not run'}.get(c, 'timeout' if c in (-24, 24, 36) else f'exit {c}'); \
	counts = collections.defaultdict(collections.Counter); [counts[n.split('.')[1]].update([kind(codes.get(n))]) for n in names]; \
	[print(mod, dict(c), 'score %d/%d' % (c['killed'] + c['timeout'], sum(c.values()) - c['not run'])) for mod, c in counts.items()]; \
	[print(kind(codes.get(n)), n) for n in sorted(names) if kind(codes.get(n)) in ('survived', 'no tests')]"
