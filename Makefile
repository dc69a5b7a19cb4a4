# EPL build and test entry points.  `make demo` and `make test` set up
# everything they need on a fresh machine (see README.md).
#
# TensorFlow lines from one code base:
#   TF=1     TensorFlow 1.15.5 on Python 3.7              -> .venv,        epl/lib/libepl_ops.so
#   TF=2     TensorFlow 2.21 (+ tf-keras) on Python 3.11+ -> .venv-tf2,    epl/lib/libepl_ops-tf2.21.so
#   TF=2.15  TensorFlow 2.15 + tensorflow-estimator + tf-keras on Python 3.11, optional, for
#            Estimator programs (tf.estimator is gone from 2.16 on)
#                                                         -> .venv-tf2.15, epl/lib/libepl_ops-tf2.15.so
# Without TF=..., line 1 when a Python 3.7 is found (tools/find_python.sh), otherwise line 2.
SHELL := /bin/bash
ifndef TF
TF := $(shell tools/find_python.sh 1 >/dev/null 2>&1 && echo 1 || echo 2)
ifeq ($(TF),2)
$(info No Python 3.7 found (tools/find_python.sh 1): using the TensorFlow 2.x line, .venv-tf2 (TF=1 forces 1.15))
endif
endif
TF2_VERSION := 2.21.0
TF215_VERSION := 2.15.1
ifeq ($(TF),1)
VENV := .venv
OPS_SO := epl/lib/libepl_ops.so
TF_PACKAGES := tensorflow==1.15.5 'numpy<1.19' 'protobuf<3.21' tf-slim==1.1.0
PIP_PIN := 'pip<24'
else ifeq ($(TF),2)
VENV := .venv-tf2
OPS_SO := epl/lib/libepl_ops-tf$(basename $(TF2_VERSION)).so
TF_PACKAGES := tensorflow-cpu==$(TF2_VERSION) tf-keras==$(TF2_VERSION)
PIP_PIN := pip
# tf.keras is Keras 3 from TF 2.16 on unless tf-keras is installed and this is set.
export TF_USE_LEGACY_KERAS := 1
else ifeq ($(TF),2.15)
VENV := .venv-tf2.15
OPS_SO := epl/lib/libepl_ops-tf2.15.so
# 2.15 is the last TensorFlow with tf.estimator (tensorflow-estimator 2.15); its tf.keras is
# Keras 2 already, tf-keras 2.15 is the same Keras for programs that import tf_keras.
TF_PACKAGES := tensorflow==$(TF215_VERSION) tensorflow-estimator==2.15.0 tf-keras==2.15.1
PIP_PIN := pip
export TF_USE_LEGACY_KERAS := 1
else
$(error TF=$(TF): use TF=1 (TensorFlow 1.15, Python 3.7), TF=2 (TensorFlow 2.x, Python 3.11+) or TF=2.15 (TensorFlow 2.15 with the Estimator, Python 3.11))
endif
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.epl-installed
CSRC := $(wildcard csrc/*.cc csrc/*.h csrc/build.py)

.PHONY: setup demo test oracle-tests test-eager-off test-estimator bench ops clean horovod docs gpu-ops-check xeon-compile-check

setup: $(STAMP) $(OPS_SO)

$(STAMP): setup.py
	@PYBIN=$$(tools/find_python.sh $(TF)) || exit 1; \
	if [ ! -x $(PY) ]; then echo "Creating $(VENV) (TensorFlow line $(TF)) with $$PYBIN"; "$$PYBIN" -m venv $(VENV) || exit 1; fi
	$(PIP) install -q --disable-pip-version-check $(PIP_PIN)
	$(PIP) install -q --disable-pip-version-check $(TF_PACKAGES) pytest pytest-timeout pytest-xdist
	$(PIP) install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

ops: $(OPS_SO)

$(OPS_SO): $(STAMP) $(CSRC)
	$(PY) csrc/build.py --out $(OPS_SO)

demo: setup
	$(PY) examples/quick_start/run_demo.py

test: setup
	tools/run_tests.sh $(PY) tests

# The strategies' oracle tests in TF 2.x's other graph mode: disable_eager_execution()
# alone (shapes index to ints, resource variables, control flow v2), as users write it
# (tests/conftest.py, EPL_TEST_GRAPH_MODE).  `make test` runs them after
# disable_v2_behavior(); .ci/run runs this too on the TF 2.x line.
ORACLE_TESTS := $(addprefix tests/test_,$(addsuffix .py,data_parallel pipeline split layouts \
	zero gradient_checkpoint amp offload grouped_apply accumulate_runs moe_user_layer \
	static_shapes corpus update_paths gradient_paths auto_stages read_order metrics split_attention split_comm split_bert \
	split_hybrids))
oracle-tests:    # (the list, for .ci/run)
	@echo $(ORACLE_TESTS)
test-eager-off: setup
	@if [ "$(TF)" != 2 ]; then echo "make test-eager-off: a TF 2.x mode; use TF=2"; exit 2; fi
	EPL_TEST_GRAPH_MODE=eager_off tools/run_tests.sh $(PY) $(ORACLE_TESTS) -k "not under_load"

# The Estimator line's check (TF=2.15; TF=1 too): every Estimator test (marker
# `estimator`, tests/conftest.py), a smoke set of the strategies' oracles (data parallel,
# pipeline, split, tf.keras fit, no deprecation warnings from EPL, the public API), then
# the quick start (`make demo`).  .ci/run runs it on TF 2.15, not the whole suite.
ESTIMATOR_TESTS := $(shell grep -l 'mark\.estimator' tests/test_*.py)
SMOKE_TESTS := 'tests/test_data_parallel.py::test_dp_matches_big_batch[2-adam-monitored-per_device]' \
	'tests/test_pipeline.py::test_pipeline_equals_local[2-2-2-PreferBackward]' \
	'tests/test_split.py::test_whole_model_split_matches_local[2]' \
	'tests/test_keras_metrics.py::test_keras_reports_the_global_batch[dp2]' \
	tests/test_warnings.py tests/test_patching_deprecation.py tests/test_public_api.py
test-estimator: $(if $(filter 2,$(TF)),,setup)
	@if [ "$(TF)" = 2 ]; then echo "make test-estimator: TensorFlow 2.16+ has no tf.estimator; use TF=2.15 (or TF=1)"; exit 2; fi
	$(PY) -m pytest -q -m estimator $(ESTIMATOR_TESTS)
	$(PY) -m pytest -q -m 'not estimator' $(SMOKE_TESTS)
	$(PY) examples/quick_start/run_demo.py

bench: setup
	$(PY) benchmarks/run_all.py

docs: $(STAMP)
	$(PY) -c 'import sys, epl.core.config; sys.stdout.write(epl.core.config.markdown())' > docs/config.md

# Horovod with Gloo in its own venv, only for the collectives comparison.
horovod: $(STAMP)
	@PYBIN=$$(tools/find_python.sh 1) || exit 1; \
	[ -x .venv-horovod/bin/python ] || "$$PYBIN" -m venv .venv-horovod
	.venv-horovod/bin/pip install -q 'pip<24' && .venv-horovod/bin/pip install -q tensorflow==1.15.5 'numpy<1.19' 'protobuf<3.21' cffi psutil pyyaml cloudpickle packaging
	HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
	  .venv-horovod/bin/pip install --no-cache-dir --no-build-isolation horovod==0.28.1
	.venv-horovod/bin/pip install -q --no-deps -e .

# Compile and link the NCCL backend against both TensorFlow lines, from pip wheels of
# TensorFlow's CUDA builds, CUDA and NCCL: tensorflow-gpu 1.15.5 + CUDA 11.8 in .venv-gpu
# (Python 3.7), tensorflow 2.21.0 + CUDA 12.5 in .venv-gpu-tf2 (Python 3.11+); one OK line
# per line (no GPU needed; nothing is run).  tools/gpu_ops_check.sh 1|2 checks one line.
gpu-ops-check:
	tools/gpu_ops_check.sh

# Compile csrc/*.cc (no link, nothing run) against both lines' venvs with the instruction
# sets of a current Xeon (-march=sapphirerapids; TF 2.x: -mno-avx512fp16, which TensorFlow
# 2.21's Eigen needs with GCC 12), and check that the libraries `make setup` built target
# the portable baseline (csrc/build.py), not the building CPU.  Needs both lines set up.
xeon-compile-check:
	tools/xeon_compile_check.sh

clean:
	rm -rf .venv .venv-tf2 .venv-tf2.15 .venv-gpu .venv-gpu-tf2 epl/lib/*.so epl/lib/*.json csrc/build build *.egg-info
