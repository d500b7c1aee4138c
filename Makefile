# make demo  - set up .venv and run the main job on an embedded default
# make test  - set up .venv and run the test suite
# make bench - run every benchmark script (prints tables and JSON lines)
# make bazel-test - the Bazel build: C++ unit tests, then the ops tests on Bazel's jodc._ffi (installs Bazel with apt)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NATIVE_SOURCES := $(shell find ffi -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py') setup.py
INSTALLED := $(VENV)/.jodc-installed
JODC_CUDA ?=
NATIVE := $(VENV)/.jodc-native$(if $(filter-out 0,$(JODC_CUDA)),-cuda,)

.PHONY: setup native test demo demo-rl bench clean cuda-check bazel-configure bazel-test

setup: $(NATIVE)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Dependencies first (the build needs jaxlib's FFI headers), then the project itself in editable mode.
$(INSTALLED): $(PY) pyproject.toml constraints-cpu.txt
	$(PIP) install --quiet -c constraints-cpu.txt "setuptools>=69" wheel "pybind11>=2.12,<4" "jaxlib>=0.10.2,<0.13"
	$(PIP) install --quiet -c constraints-cpu.txt --no-build-isolation -e ".[test,mpi]"
	touch $@

# Rebuild the native extension in place whenever a native source changes (JODC_CUDA=1 adds the CUDA library and
# has its own stamp, so switching it on after a CPU-only build rebuilds). The MPI library (jodc/_ffi_mpi.so) is
# built too when the mpi extra's mpicxx is in the venv.
$(NATIVE): $(INSTALLED) $(NATIVE_SOURCES)
	JODC_CUDA=$(JODC_CUDA) $(PY) setup.py --quiet build_ext --inplace
	touch $@

native: $(NATIVE)

test: $(NATIVE)
	$(PY) -m pytest -q -x --durations=15 tests

# The main job: SFT of the default small model with ODC on 4 simulated CPU devices, on the embedded data (a fresh
# run directory each time; rerun a finished one with --steps N to extend it). `make demo-rl`: the RL stage.
demo: $(NATIVE)
	$(PY) -m jodc.train sft --config configs/sft_demo.yaml --out_dir runs/sft_demo_$$(date +%Y%m%d_%H%M%S)

# RL on the shipped arithmetic task (DPPO, ODC, a warm start by SFT first): the mean reward rises in about 1-2 min.
demo-rl: $(NATIVE)
	$(PY) -m jodc.train rl --config configs/rl_demo.yaml --out_dir runs/rl_demo_$$(date +%Y%m%d_%H%M%S)

bench: $(NATIVE)
	for f in bench/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

# Compile and link the CUDA kernels (sm_80, sm_90) without needing a GPU.
cuda-check: $(INSTALLED)
	$(PY) ffi/build_cuda.py --out build/cuda-check/_ffi_cuda.so

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
