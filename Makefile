# EPL build and test entry points.  `make demo` and `make test` set up
# everything they need on a fresh machine (see README.md).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.epl-installed
OPS_SO := epl/lib/libepl_ops.so
CSRC := $(wildcard csrc/*.cc csrc/*.h csrc/build.py)

.PHONY: setup demo test bench ops clean horovod docs gpu-ops-check

setup: $(STAMP) $(OPS_SO)

$(STAMP): setup.py
	@PYBIN=$$(tools/find_python37.sh) || exit 1; \
	if [ ! -x $(PY) ]; then echo "Creating $(VENV) with $$PYBIN"; "$$PYBIN" -m venv $(VENV) || exit 1; fi
	$(PIP) install -q --disable-pip-version-check 'pip<24'
	$(PIP) install -q --disable-pip-version-check tensorflow==1.15.5 'numpy<1.19' 'protobuf<3.21' pytest pytest-timeout
	$(PIP) install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

ops: $(OPS_SO)

$(OPS_SO): $(STAMP) $(CSRC)
	$(PY) csrc/build.py --out $(OPS_SO)

demo: setup
	$(PY) examples/quick_start/run_demo.py

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/run_all.py

docs: $(STAMP)
	$(PY) -c 'import sys, epl.config; sys.stdout.write(epl.config.markdown())' > docs/config.md

# Horovod with Gloo in its own venv, only for the collectives comparison.
horovod: $(STAMP)
	@PYBIN=$$(tools/find_python37.sh) || exit 1; \
	[ -x .venv-horovod/bin/python ] || "$$PYBIN" -m venv .venv-horovod
	.venv-horovod/bin/pip install -q 'pip<24' && .venv-horovod/bin/pip install -q tensorflow==1.15.5 'numpy<1.19' 'protobuf<3.21' cffi psutil pyyaml cloudpickle packaging
	HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
	  .venv-horovod/bin/pip install --no-cache-dir --no-build-isolation horovod==0.28.1
	.venv-horovod/bin/pip install -q --no-deps -e .

# Compile and link the NCCL backend against pip wheels of tensorflow-gpu, CUDA and NCCL
# (no GPU needed; nothing is run).
gpu-ops-check:
	tools/gpu_ops_check.sh

clean:
	rm -rf $(VENV) epl/lib/*.so epl/lib/*.json csrc/build build *.egg-info
