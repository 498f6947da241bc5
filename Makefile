# make test        : set up .venv with the tested versions (constraints/tested.txt) and run the test suite
# make test-latest : the same suite in .venv-latest with the newest release of every dependency but torch,
#                    after printing what differs from the tested set and what normkit.patch recognises there
# make bench       : set up .venv and run the benchmark (on a machine without a GPU it runs the CPU paths)
# make lock        : write constraints/tested.txt from .venv (after a green make test-latest, into .venv)
VENV ?= .venv
LATEST_VENV ?= .venv-latest
PY := $(VENV)/bin/python
LATEST_PY := $(LATEST_VENV)/bin/python
# pinned so pip never pulls the multi-GB CUDA build on a CPU machine; override on a GPU box
TORCH_SPEC ?= torch==2.13.0
TESTED := constraints/tested.txt
# the Triton release on the GPU machine the benchmarks run on: tests/test_fusion.py compiles every kernel variant for
# sm_90 with it too (code that triton 3.9 accepts has failed on 3.6), from a copy unpacked beside the venv's packages
DEVICE_TRITON ?= 3.6.0
device_triton = rm -rf $(1)/device-triton && \
	$(1)/bin/python -m pip download -q --no-deps --only-binary=:all: "triton==$(DEVICE_TRITON)" -d $(1)/device-triton && \
	$(1)/bin/python -c "import glob, zipfile; zipfile.ZipFile(glob.glob('$(1)/device-triton/triton-*.whl')[0]).extractall('$(1)/device-triton/site')" && \
	chmod +x $(1)/device-triton/site/triton/backends/nvidia/bin/* && rm $(1)/device-triton/triton-*.whl && \
	touch $(1)/device-triton/.ok-$(DEVICE_TRITON)
# the NVRTC release on the GPU machine (its CUDA 13.0): tests/test_cuda_backend.py compiles the CUDA kernels with it
# too (source that NVRTC 13.5 compiles crashed 13.0's front end, session 27); only its two libraries are unpacked
DEVICE_NVRTC ?= 13.0
device_nvrtc = rm -rf $(1)/device-nvrtc && \
	$(1)/bin/python -m pip download -q --no-deps --only-binary=:all: "nvidia-cuda-nvrtc==$(DEVICE_NVRTC).*" -d $(1)/device-nvrtc && \
	$(1)/bin/python -c "import glob, re, zipfile; z = zipfile.ZipFile(glob.glob('$(1)/device-nvrtc/nvidia_cuda_nvrtc-*.whl')[0]); \
		z.extractall('$(1)/device-nvrtc/site', [n for n in z.namelist() if re.search(r'/libnvrtc(-builtins)?\.so[.0-9]*$$', n)])" && \
	rm $(1)/device-nvrtc/nvidia_cuda_nvrtc-*.whl && touch $(1)/device-nvrtc/.ok-$(DEVICE_NVRTC)
PYTEST_ARGS ?=

.PHONY: test test-latest bench setup lock clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml $(TESTED)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c $(TESTED) -e ".[test,bench]"
	touch $@

# a stamp of its own: a venv made before it (or for another DEVICE_TRITON) gets it without a rebuild
$(VENV)/device-triton/.ok-$(DEVICE_TRITON): $(VENV)/.ready
	$(call device_triton,$(VENV))

$(VENV)/device-nvrtc/.ok-$(DEVICE_NVRTC): $(VENV)/.ready
	$(call device_nvrtc,$(VENV))

test: setup $(VENV)/device-triton/.ok-$(DEVICE_TRITON) $(VENV)/device-nvrtc/.ok-$(DEVICE_NVRTC)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 -q $(PYTEST_ARGS)

test-latest:
	rm -rf $(LATEST_VENV)
	python3 -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install -q --upgrade pip
	$(LATEST_PY) -m pip install -q "$(TORCH_SPEC)"
	$(LATEST_PY) -m pip install -q --upgrade --upgrade-strategy eager -c constraints/latest.txt -e ".[test,bench]"
	$(call device_triton,$(LATEST_VENV))
	$(call device_nvrtc,$(LATEST_VENV))
	@newer=$$($(LATEST_PY) -m pip freeze 2>/dev/null | grep -v -e '^-e ' -e '^#' -e '^normkit' -e '^torch==' \
		| grep -v -x -F -f $(TESTED)); echo "make test-latest: versions that differ from $(TESTED):"; \
		echo "$${newer:-(none: the newest releases are the tested set)}" | sed 's/^/    /'
	$(LATEST_PY) -m normkit recognition
	OMP_NUM_THREADS=1 $(LATEST_PY) -m pytest -n 2 -q $(PYTEST_ARGS)

bench: setup
	$(PY) -m normkit bench $(BENCH_ARGS)

# no `setup` prerequisite: that would reinstall the tested set into the venv being locked (make lock VENV=.venv-latest)
lock:
	@test -x $(PY) || { echo "make lock: $(PY) is missing: run make test-latest (or make setup) first" >&2; exit 1; }
	{ sed -n '1,2p' $(TESTED); $(PY) -m pip freeze 2>/dev/null | grep -v -e '^-e ' -e '^#' -e '^normkit' -e '^torch==' \
		| sort -f; } > $(TESTED).new && mv $(TESTED).new $(TESTED)

clean:
	rm -rf $(VENV) $(LATEST_VENV) .pytest_cache
