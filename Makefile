# make demo  - set up .venv and run the main job on an embedded default
# make test  - set up .venv and run the test suite
# make bench - run every benchmark script (prints tables and JSON lines)
# make bazel-test - the Bazel build: C++ unit tests, then the ops tests on Bazel's jodc._ffi (installs Bazel with apt)
# make cuda-check - compile + link the CUDA library (sm_80, sm_90) without a GPU, check its exports and reductions
# make test-gpu - on a GPU runner: own venv with the CUDA jax stack, CUDA build, report, whole suite + CUDA tests
# make sanitize-gpu - on a GPU runner: compute-sanitizer memcheck + racecheck of the single-GPU CUDA tests
# make gpu-check - on a GPU runner with a CUDA jax already installed (no venv, no index): build, every GPU check,
#                  the GPU benchmarks and an SFT smoke run inside one time budget; summary.json + logs in GPU_CHECK_OUT
# make gpu-wheels - (where a package index is reachable) the pure-Python wheels such a runner lacks, for Python 3.12
# make docs - build the docs site into site/ with warnings as errors (own venv .venv-docs; every link and anchor checked)
# make lint - ruff's pyflakes checks (undefined names, unused imports) over every tracked Python file
# make test-py312 - the suite on Python 3.12 with the GPU image's jax (0.11.2), without torch/transformers
# make test-jax-latest - on Python 3.12 with the newest jax (0.12.x): the library imports, the ops and CP tests pass
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NATIVE_SOURCES := $(shell find ffi -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py') setup.py
INSTALLED := $(VENV)/.jodc-installed
JODC_CUDA ?=
NATIVE := $(VENV)/.jodc-native$(if $(filter-out 0,$(JODC_CUDA)),-cuda,)

.PHONY: setup native test demo demo-rl bench clean cuda-check bazel-configure bazel-test test-gpu sanitize-gpu \
	gpu-setup lint docs test-py312 test-jax-latest py312-setup gpu-check gpu-wheels

setup: $(NATIVE)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Dependencies first (the build needs jaxlib's FFI headers), then the project itself in editable mode.
$(INSTALLED): $(PY) pyproject.toml constraints-cpu.txt
	$(PIP) install --quiet -c constraints-cpu.txt "setuptools>=77.0.1" wheel "pybind11>=2.12,<4" "jaxlib>=0.10.2,<0.13"
	$(PIP) install --quiet -c constraints-cpu.txt --no-build-isolation -e ".[test,hf-reference,mpi]"
	touch $@

# Rebuild the native extension in place whenever a native source changes (JODC_CUDA=1 adds the CUDA library and
# has its own stamp, so switching it on after a CPU-only build rebuilds). The MPI library (jodc/_ffi_mpi.so) is
# built too when the mpi extra's mpicxx is in the venv.
$(NATIVE): $(INSTALLED) $(NATIVE_SOURCES)
	JODC_CUDA=$(JODC_CUDA) $(PY) setup.py --quiet build_ext --inplace
	touch $@

native: $(NATIVE)

# The suite runs on PYTEST_WORKERS pytest-xdist workers (0: one process, no xdist), each taking a whole test file at a
# time (--dist loadfile: a module's fixtures, such as a trained run that several tests read, are built once), the
# heaviest files first (tests/conftest.py's HEAVIEST_FIRST; --no-loadscope-reorder keeps that order). The
# serial suite keeps about 1.3 of CI's 2 cores busy (much of it is single-threaded compilation and Python); two
# workers fill both. The workers share one XLA compilation cache (tests/conftest.py).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(NATIVE)
	$(PY) -m pytest -q -x $(PYTEST_PARALLEL) --durations=30 tests

# The main job: SFT of the default small model with ODC on 4 simulated CPU devices, on the embedded data (a fresh
# run directory each time; rerun a finished one with --steps N to extend it). `make demo-rl`: the RL stage.
demo: $(NATIVE)
	$(PY) -m jodc.train sft --config configs/sft_demo.yaml --out_dir runs/sft_demo_$$(date +%Y%m%d_%H%M%S)

# RL on the shipped arithmetic task (DPPO, ODC, a short SFT warm start first), about 2 min on 2 idle cores: held-out
# greedy accuracy and sampled reward both rise from the warm start (3 seeds: docs/rl.md, "The demo").
demo-rl: $(NATIVE)
	$(PY) -m jodc.train rl --config configs/rl_demo.yaml --out_dir runs/rl_demo_$$(date +%Y%m%d_%H%M%S)

# Every benchmark module (bench/harness.py and bench/device_timing.py are their shared parts), as `python -m bench.<name>`.
BENCHMARKS := $(filter-out __init__ harness device_timing,$(basename $(notdir $(wildcard bench/*.py))))
bench: $(NATIVE)
	for m in $(BENCHMARKS); do echo "== bench.$$m"; $(PY) -m bench.$$m || exit 1; done

# Compile and link the CUDA kernels (sm_80, sm_90) without needing a GPU (CI runs this: .ci/run), keeping the PTX to
# check the scatter kernel's reductions (vector on sm_90, scalar on sm_80); then tests/test_cuda_build.py checks the
# built library's exports and loads it (the plain suite skips those tests, so `make test` pays no nvcc time).
CUDA_CHECK_DIR := build/cuda-check
NVCC ?= nvcc
CUDA_MAJOR ?= $(shell $(NVCC) --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\)\..*/\1/p')
# The NVSHMEM backend (ffi/nvshmem) is compiled and linked too, against the nvidia-nvshmem wheel matching nvcc's CUDA
# major version (installed into the venv here, pinned in constraints-cuda.txt).
CUDA_CHECK_NVSHMEM := $(VENV)/.jodc-nvshmem-cu$(CUDA_MAJOR)
$(CUDA_CHECK_NVSHMEM): $(INSTALLED) constraints-cuda.txt
	@test -n "$(CUDA_MAJOR)" || { echo "make cuda-check needs nvcc on PATH"; exit 1; }
	$(PIP) install --quiet -c constraints-cuda.txt "nvidia-nvshmem-cu$(CUDA_MAJOR)"
	touch $@

cuda-check: $(INSTALLED) $(CUDA_CHECK_NVSHMEM)
	rm -rf $(CUDA_CHECK_DIR)/keep
	$(PY) ffi/build_cuda.py --out $(CUDA_CHECK_DIR)/_ffi_cuda.so --keep-dir $(CUDA_CHECK_DIR)/keep
	$(PY) ffi/build_nvshmem.py --out $(CUDA_CHECK_DIR)/_ffi_nvshmem.so
	JODC_CUDA_CHECK_LIBRARY=$(CURDIR)/$(CUDA_CHECK_DIR)/_ffi_cuda.so \
		JODC_NVSHMEM_CHECK_LIBRARY=$(CURDIR)/$(CUDA_CHECK_DIR)/_ffi_nvshmem.so \
		$(PY) -m pytest -q -p no:cacheprovider tests/test_cuda_build.py

# ---- Lint ---------------------------------------------------------------------------------------------------------
# ruff with pyflakes' rules only (pyproject.toml [tool.ruff.lint]) over every file git tracks (ruff skips what
# .gitignore ignores), in a venv of its own: CI runs it first, before any install (seconds).
RUFF_VERSION ?= 0.17.6
LINT_VENV ?= .venv-lint
LINT_RUFF := $(LINT_VENV)/.ruff-$(RUFF_VERSION)

$(LINT_RUFF):
	$(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install --quiet "ruff==$(RUFF_VERSION)"
	touch $@

lint: $(LINT_RUFF)
	$(LINT_VENV)/bin/ruff check

# ---- Docs -----------------------------------------------------------------------------------------------------------
# The site (mkdocs.yml): README.md as the home page, the guides of docs/, the API reference from the docstrings. Its
# packages (pyproject.toml's `docs` extra, pinned by constraints-docs.txt) go into a venv of their own without the
# project: griffe reads the sources statically, so nothing imports JAX and .venv's setup does not grow (install about
# 15 s, build a few seconds). --strict: a warning (a broken link or anchor, a page outside the nav) fails the build.
DOCS_VENV ?= .venv-docs
DOCS_INSTALLED := $(DOCS_VENV)/.jodc-docs-installed
DOCS_EXTRA = $(shell $(PYTHON) -c 'import tomllib; print(" ".join(repr(r) for r in \
	tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')

$(DOCS_INSTALLED): pyproject.toml constraints-docs.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet -c constraints-docs.txt $(DOCS_EXTRA)
	touch $@

docs: $(DOCS_INSTALLED)
	$(DOCS_VENV)/bin/python tools/docs/hooks.py
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --quiet

# ---- Python 3.12: the GPU image's jax, and the newest jax -----------------------------------------------------
# jax 0.11+ needs Python 3.12+, and the GPU runners' image has Python 3.12 with jax 0.11.2. `make test-py312` runs the
# whole suite there (versions: constraints-py312.txt); `make test-jax-latest` runs JAX_LATEST_TESTS (every module
# imports, the ops tests, the context-parallel exchange and engine tests: the group ops' compile) on the newest jax,
# JAX_LATEST (the rest pinned as for test-py312). Each has its own venv
# (.venv-py312, .venv-jax-latest) and its own copy of the tree (build/py312/src, build/jax-latest/src: the files git
# tracks or would track, synced at each run with their mtimes, so the native build there is incremental), because the
# native libraries are built in place (jodc/_ffi*.so) and one Python's or jaxlib's build would overwrite another's.
# Neither installs torch/transformers (the hf-reference extra: PyPI's torch for Python 3.12 is a multi-GB CUDA
# build); the tests that compare against them skip (tests/conftest.py: hf_reference). PYTHON312 names the interpreter
# (default: python3.12 on PATH, else pyenv's); PY312_TESTS narrows test-py312 (default: the whole suite).
PYTHON312 ?= $(shell for p in python3.12 "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
JAX_LATEST ?= 0.12.0.1
PY312_TESTS ?= tests
JAX_LATEST_TESTS ?= tests/test_imports.py tests/test_ops.py tests/test_ops_faults.py tests/test_ops_targets.py \
	tests/test_context_parallel_group.py tests/test_fsdp_context_parallel.py tests/test_context_parallel_odc.py
PY312_VENV ?= .venv-py312
JAX_LATEST_VENV ?= .venv-jax-latest

# $(call py312_sync,DIR): DIR/src becomes a copy of the tree's tracked and untracked-but-not-ignored files (the files
# an earlier copy had that are gone now are removed; build outputs there stay).
define py312_sync
	@git rev-parse --git-dir >/dev/null 2>&1 || { echo "make $@ copies the tree with git ls-files: needs a checkout"; \
		exit 1; }
	@mkdir -p $(1)/src
	@git ls-files --cached --others --exclude-standard | while IFS= read -r f; do [ -f "$$f" ] && printf '%s\n' "$$f"; \
		done | sort > $(1)/files.new
	@if [ -f $(1)/files ]; then comm -23 $(1)/files $(1)/files.new | (cd $(1)/src && xargs -r -d '\n' rm -f); fi
	@tar -cf - -T $(1)/files.new | tar -xf - -C $(1)/src
	@mv $(1)/files.new $(1)/files
endef

# $(call py312_install,VENV,DIR,CONSTRAINTS): a Python 3.12 venv with DIR/src installed in editable mode (its native
# extension built in place), its test and mpi extras, pinned by CONSTRAINTS.
define py312_install
	@test -n "$(PYTHON312)" || { echo "no Python 3.12 found (python3.12 on PATH, or pyenv's versions/3.12*):" \
		"install one (pyenv install 3.12) or pass PYTHON312=/path/to/python3.12"; exit 1; }
	$(PYTHON312) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet -c $(3) "setuptools>=77.0.1" wheel "pybind11>=2.12,<4" jax jaxlib
	$(1)/bin/python -m pip install --quiet -c $(3) --no-build-isolation -e "./$(2)/src[test,mpi]"
endef

# $(call py312_native,VENV,DIR): the native libraries of DIR/src, built in place by VENV's Python.
define py312_native
	cd $(2)/src && $(abspath $(1))/bin/python setup.py --quiet build_ext --inplace
endef

PY312_INSTALLED := $(PY312_VENV)/.jodc-installed
$(PY312_INSTALLED): pyproject.toml constraints-py312.txt
	$(call py312_sync,build/py312)
	$(call py312_install,$(PY312_VENV),build/py312,constraints-py312.txt)
	touch $@

test-py312: $(PY312_INSTALLED)
	$(call py312_sync,build/py312)
	$(call py312_native,$(PY312_VENV),build/py312)
	cd build/py312/src && $(abspath $(PY312_VENV))/bin/python -m pytest -q -x -rs $(PYTEST_PARALLEL) --durations=15 \
		$(PY312_TESTS)

# constraints-py312.txt with jax/jaxlib replaced by JAX_LATEST
JAX_LATEST_CONSTRAINTS := $(JAX_LATEST_VENV)/constraints-jax$(JAX_LATEST).txt
JAX_LATEST_INSTALLED := $(JAX_LATEST_VENV)/.jodc-installed-jax$(JAX_LATEST)
$(JAX_LATEST_CONSTRAINTS): constraints-py312.txt
	mkdir -p $(dir $@)
	{ sed '/^jax\(lib\)\?==/d' $<; echo "jax==$(JAX_LATEST)"; echo "jaxlib==$(JAX_LATEST)"; } > $@

$(JAX_LATEST_INSTALLED): pyproject.toml $(JAX_LATEST_CONSTRAINTS)
	$(call py312_sync,build/jax-latest)
	$(call py312_install,$(JAX_LATEST_VENV),build/jax-latest,$(JAX_LATEST_CONSTRAINTS))
	touch $@

test-jax-latest: $(JAX_LATEST_INSTALLED)
	$(call py312_sync,build/jax-latest)
	$(call py312_native,$(JAX_LATEST_VENV),build/jax-latest)
	cd build/jax-latest/src && $(abspath $(JAX_LATEST_VENV))/bin/python -m pytest -q -x -rs $(JAX_LATEST_TESTS)

# Both Python 3.12 venvs installed, nothing run: .ci/run starts this in the background while the 3.11 suite runs
# (mostly downloads), so test-py312 and test-jax-latest find them ready.
py312-setup: $(PY312_INSTALLED) $(JAX_LATEST_INSTALLED)

# ---- GPU runners ------------------------------------------------------------------------------------------------
# A venv of its own (.venv-gpu) with the CUDA build of jax pinned in constraints-cuda.txt: jax[cuda12] or jax[cuda13]
# after the CUDA major version of the nvcc on PATH (override: make test-gpu CUDA_MAJOR=12). Needs a GPU, its driver,
# and the CUDA toolkit (nvcc; compute-sanitizer for sanitize-gpu).
GPU_VENV ?= .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_INSTALLED := $(GPU_VENV)/.jodc-installed
COMPUTE_SANITIZER ?= $(or $(shell command -v compute-sanitizer 2>/dev/null),$(dir $(shell command -v $(NVCC) 2>/dev/null))compute-sanitizer)

$(GPU_INSTALLED): pyproject.toml constraints-cuda.txt
	@test -n "$(CUDA_MAJOR)" || { echo "make test-gpu needs the CUDA toolkit's nvcc on PATH (CUDA 12.8+ or 13)"; exit 1; }
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install --quiet --upgrade pip
	$(GPU_PY) -m pip install --quiet -c constraints-cuda.txt "setuptools>=77.0.1" wheel "pybind11>=2.12,<4" \
		"jax[cuda$(CUDA_MAJOR)]" "nvidia-nvshmem-cu$(CUDA_MAJOR)"
	$(GPU_PY) -m pip install --quiet -c constraints-cuda.txt --no-build-isolation -e ".[test,hf-reference,mpi]"
	touch $@

# The CUDA build in place (jodc/_ffi_cuda.so next to the package; rebuilt every time: nvcc sees every change).
gpu-setup: $(GPU_INSTALLED)
	JODC_CUDA=1 JODC_NVSHMEM=1 $(GPU_PY) setup.py --quiet build_ext --inplace

# The GPU runner's one command: the report (GPUs, driver, peer access and atomics per pair, transport), then the whole
# suite with the CUDA tests required (JODC_REQUIRE_GPU=1: no GPU or no CUDA build is an error, not a skip), the
# library checks of tests/test_cuda_build.py against the in-place build, and a final check that no CUDA test skipped
# (except the documented hardware skips: a second GPU, memory for the 2^31-element bucket).
test-gpu: gpu-setup
	mkdir -p build
	$(GPU_PY) tools/cuda_report.py
	JODC_REQUIRE_GPU=1 JODC_CUDA_CHECK_LIBRARY=$(CURDIR)/jodc/_ffi_cuda.so \
		JODC_NVSHMEM_CHECK_LIBRARY=$(CURDIR)/jodc/_ffi_nvshmem.so \
		$(GPU_PY) -m pytest -q -rs --durations=15 --junitxml=build/gpu-junit.xml tests; \
		status=$$?; $(GPU_PY) tools/cuda_report.py --check-junit build/gpu-junit.xml || exit 1; exit $$status

# compute-sanitizer's memcheck and racecheck over the single-GPU CUDA tests (the handlers driven directly, several
# positions simulated on one GPU: every kernel and both accumulation modes), limited to jodc's kernels.
SANITIZE_TESTS ?= tests/test_ops_cuda.py -m raw_handlers
sanitize-gpu: gpu-setup
	@test -x "$(COMPUTE_SANITIZER)" || { echo "compute-sanitizer not found (CUDA toolkit bin/; COMPUTE_SANITIZER=...)"; exit 1; }
	for tool in memcheck racecheck; do \
		JODC_REQUIRE_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false $(COMPUTE_SANITIZER) --tool $$tool --error-exitcode 97 \
			--kernel-name kns=jodc --report-api-errors no \
			$(GPU_PY) -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS) || exit 1; \
	done

# A thin wrapper of tools/gpu_check.py, the one command for a GPU runner that already has a CUDA jax (the runner may
# have no make: the Python command is the primary one, docs/cuda.md gives it): an overlay environment on GPU_PYTHON
# (its packages as they are, jodc from this checkout, missing pure-Python packages from GPU_WHEELS), the build (reused
# when its sources match), then every check by value, each under its own limit, inside GPU_CHECK_BUDGET seconds.
# GPU_CHECK_OUT receives summary.json, junit.xml and logs.tar.gz (nothing else: working files go to GPU_CHECK_WORK).
# ONLY=step,step runs chosen steps (after prepare, env and build); REUSE_BUILD=1 states the reuse of the build.
# `python3 tools/gpu_check.py --list` shows the steps and their limits.
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= build/gpu-check
GPU_CHECK_WORK ?= build/gpu-check-work
GPU_ENV ?= build/gpu-env
GPU_CHECK_BUDGET ?= 480
GPU_WHEELS ?= build/gpu-wheels
GPU_ARCHS ?= 90
ONLY ?=
REUSE_BUILD ?=
NVSHMEM ?=
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py --out $(GPU_CHECK_OUT) --work-dir $(GPU_CHECK_WORK) --env-dir $(GPU_ENV) \
		--budget-s $(GPU_CHECK_BUDGET) --archs $(GPU_ARCHS) $(if $(wildcard $(GPU_WHEELS)),--wheels $(GPU_WHEELS)) \
		$(if $(ONLY),--only $(ONLY)) $(if $(filter-out 0,$(REUSE_BUILD)),--reuse-build) \
		$(if $(filter-out 0,$(NVSHMEM)),--nvshmem)

# What a CUDA jax image may lack (tools/gpu_check.py's PURE_PYTHON_NEEDS), as wheels for Python 3.12 on x86_64 Linux,
# versions from constraints-cpu.txt where it pins them; bring the folder along (GPU_WHEELS) to a runner without network.
GPU_WHEEL_PACKAGES := draccus mergedeep toml tensorboardX typing-inspect mypy-extensions protobuf setuptools
gpu-wheels:
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform any \
		-c constraints-cpu.txt -d $(GPU_WHEELS) $(GPU_WHEEL_PACKAGES)
	ls -l $(GPU_WHEELS)

# Bazel (the reference build stays setuptools: `make native`). bazel-configure writes the venv's header paths
# (third_party/bazel/python_paths.bzl); bazel-test installs Bazel and GoogleTest with apt when missing, runs the
# C++ tests (ffi/tests/), builds //:jodc_ffi and runs the ops tests against it (JODC_FFI_LIBRARY).
BAZEL ?= bazel
bazel-configure: $(INSTALLED)
	$(PY) third_party/bazel/configure.py

bazel-test: bazel-configure
	BAZEL=$(BAZEL) third_party/bazel/install_deps.sh
	$(BAZEL) test //...
	$(BAZEL) build //:jodc_ffi
	JODC_FFI_LIBRARY=$(CURDIR)/bazel-bin/jodc/_ffi.so JODC_BAZEL=$(BAZEL) \
		$(PY) -m pytest -q -x tests/test_ops.py tests/test_bazel_build.py

clean:
	rm -rf build jodc/_ffi*.so $(NATIVE)
	if command -v $(BAZEL) >/dev/null 2>&1 && [ -f third_party/bazel/python_paths.bzl ]; then $(BAZEL) clean; fi
