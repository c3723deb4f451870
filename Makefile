# make test: venv + dependencies + build (C++ and, where a CUDA toolkit is found, CUDA) + test suite
# make demo: the same set-up, then speculative decoding with the bundled model pair
VENV ?= .venv
PY := $(VENV)/bin/python
MAX_JOBS ?= 2
export MAX_JOBS
ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
CUDA_HOME ?= /usr/local/cuda
export CUDA_HOME
endif
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cuh)

.PHONY: test demo bench install clean

$(VENV)/.deps: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch>=2.11" "transformers>=5.17" tokenizers safetensors numpy scipy tqdm \
		matplotlib pytest hypothesis ninja setuptools wheel accelerate llguidance
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.built

test: $(VENV)/.built
	$(PY) -m spec_ext backends
	TRITON_INTERPRET=1 $(PY) -m pytest -q -rs tests

demo: $(VENV)/.built
	$(PY) -m spec_ext demo

bench: $(VENV)/.built
	$(PY) benchmarks/bench_kernels.py
	$(PY) benchmarks/e2e.py

clean:
	rm -rf build $(VENV) spec_ext/*.so spec_ext/_build_info.json *.egg-info
