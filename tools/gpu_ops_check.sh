#!/usr/bin/env bash
# `make gpu-ops-check`: compile and link EPL's NCCL kernels (csrc/nccl) without a GPU,
# against both TensorFlow lines, with the CUDA runtime (+ nvcc's crt/ headers) and the NCCL
# headers and libraries of NVIDIA's pip wheels, each line in a venv of its own; one OK
# line per line, after checking that every NCCL kernel's Launch is in the library.
#   TF 1.15 (.venv-gpu, Python 3.7): tensorflow-gpu==1.15.5, CUDA 11.8, NCCL 2.21.  Two
#     builds: the mean through ncclAvg and the sum-then-scale path of NCCL < 2.10.
#   TF 2.x (.venv-gpu-tf2, Python 3.11-3.13): tensorflow==2.21.0 (PyPI's CUDA build), CUDA
#     12.5 (the version it was built with; + CCCL, which CUDA 12's cuda_fp16.h includes),
#     NCCL 2.27.  TensorFlow goes in with --no-deps, plus only the packages `import
#     tensorflow` needs (tf.sysconfig's flags), not Keras, h5py, grpcio or libclang.  One
#     build: the sum-then-scale path's TensorFlow calls (ScaleOutput) are in both builds.
#     About 1 minute on a fresh venv (downloads ~1 GB, mostly TensorFlow and NCCL).
# Nothing is run: no GPU here (and TensorFlow 1.15's GPU runtime needs CUDA 10).
#   tools/gpu_ops_check.sh [1|2]   one line only; both by default
set -euo pipefail
cd "$(dirname "$0")/.."
lines=${1:-"1 2"}
# No pip cache: the wheels (~1 GB a line) would otherwise be kept twice on disk; stop 61's
# CI ran out of space here, on a disk that other clones had filled.
export PIP_NO_CACHE_DIR=1

# Say how much disk there is before ~3 GB a line goes into the venvs, so that a failure
# for want of space reads as one.
avail_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ "${avail_kb:-0}" -lt $((4 * 1024 * 1024)) ]; then
  echo "gpu-ops-check: only $((avail_kb / 1024)) MiB free on $(df -P . | awk 'NR == 2 {print $6}');" \
       "each line's venv takes about 3 GB (free some space, or run tools/gpu_ops_check.sh 1|2" \
       "one line at a time after removing the other's .venv-gpu*)" >&2
fi

# check_kernels LIBRARY WHAT: every NCCL kernel class's Launch is in the library.
check_kernels() {
  local symbols kernel
  symbols=$(nm -C "$1")
  for kernel in NcclAllReduce NcclAllGather NcclBroadcast NcclReduce NcclReduceScatter \
                NcclAllToAll; do
    grep -qF "epl::(anonymous namespace)::$kernel::Launch" <<< "$symbols" \
      || { echo "gpu-ops-check: $kernel missing from the $2 build" >&2; exit 1; }
  done
}

use_wheels() {  # use_wheels VENV OUT CUDART_SONAME INCLUDE_PKG...: build with NVIDIA's wheels
  local site cuda nccl pkg includes=()
  site=$("$1/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  cuda="$site/nvidia/cuda_runtime"
  nccl="$site/nvidia/nccl"
  mkdir -p "$2/lib"
  # The wheels ship versioned libraries only: give the linker its plain names.
  ln -sf "$cuda/lib/$3" "$2/lib/libcudart.so"
  ln -sf "$nccl/lib/libnccl.so.2" "$2/lib/libnccl.so"
  for pkg in "${@:4}"; do includes+=("$site/nvidia/$pkg/include"); done
  export TF_CPP_MIN_LOG_LEVEL=2 CUDA_HOME="$cuda" NCCL_INCLUDE_DIR="$nccl/include" \
         CUDA_LIB_DIR="$PWD/$2/lib" CUDA_EXTRA_INCLUDES="$(IFS=:; echo "${includes[*]}")"
}

check_tf1() (
  VENV=.venv-gpu
  OUT=build/gpu-check
  PYBIN=$(tools/find_python.sh 1)
  [ -x "$VENV/bin/python" ] || "$PYBIN" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check 'pip<24'
  "$VENV/bin/pip" install -q --disable-pip-version-check tensorflow-gpu==1.15.5 \
      'numpy<1.19' 'protobuf<3.21' nvidia-cuda-runtime-cu11==11.8.89 \
      nvidia-cuda-nvcc-cu11==11.8.89 nvidia-nccl-cu11==2.21.5
  use_wheels "$VENV" "$OUT" libcudart.so.11.0 cuda_nvcc
  for variant in avg sum-then-scale; do
    defines=()
    [ "$variant" = sum-then-scale ] && defines=(--define EPL_NCCL_SUM_THEN_SCALE)
    echo "gpu-ops-check: building the NCCL backend ($variant)"
    "$VENV/bin/python" csrc/build.py --require-nccl --out "$OUT/libepl_ops_$variant.so" \
        ${defines[@]+"${defines[@]}"}
    check_kernels "$OUT/libepl_ops_$variant.so" "$variant"
  done
  echo "gpu-ops-check: OK (csrc/nccl compiled and linked against tensorflow-gpu 1.15.5," \
       "CUDA runtime 11.8 and NCCL 2.21 headers; not run: no GPU)"
)

check_tf2() (
  local venv=.venv-gpu-tf2 out=build/gpu-check-tf2 pybin start=$SECONDS
  pybin=$(tools/find_python.sh 2)
  [ -x "$venv/bin/python" ] || "$pybin" -m venv "$venv"
  # --no-deps throughout: TensorFlow's own dependencies include Keras, h5py, grpcio and
  # libclang, which tf.sysconfig does not need; these are what `import tensorflow` imports
  # (with TensorFlow 2.21's requirement specifiers, and requests' own).
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps tensorflow==2.21.0 \
      nvidia-cuda-runtime-cu12==12.5.82 nvidia-cuda-nvcc-cu12==12.5.82 \
      nvidia-cuda-cccl-cu12==12.5.39.post1 nvidia-nccl-cu12==2.27.7 \
      'numpy>=1.26.0' 'protobuf>=6.31.1,<8.0.0' 'ml_dtypes>=0.5.1,<1.0.0' 'absl-py>=1.0.0' \
      'astunparse>=1.6.0' 'flatbuffers>=25.9.23' 'gast!=0.5.0,!=0.5.1,!=0.5.2,>=0.2.1' \
      'opt_einsum>=2.3.2' packaging 'six>=1.12.0' 'termcolor>=1.1.0' \
      'typing_extensions>=3.6.6' 'wrapt>=1.11.0' 'requests>=2.21.0,<3' \
      'charset_normalizer>=2,<4' 'idna>=2.5,<4' 'urllib3>=1.21.1,<3' 'certifi>=2017.4.17'
  # (TF_ENABLE_ONEDNN_OPTS=0: no oneDNN notice from the import; nothing runs.)
  export TF_ENABLE_ONEDNN_OPTS=0
  use_wheels "$venv" "$out" libcudart.so.12 cuda_nvcc cuda_cccl
  echo "gpu-ops-check: building the NCCL backend against TensorFlow 2.21 (avg)"
  "$venv/bin/python" csrc/build.py --require-nccl --out "$out/libepl_ops_avg.so"
  check_kernels "$out/libepl_ops_avg.so" "TensorFlow 2.21"
  echo "gpu-ops-check: OK (csrc/nccl compiled and linked against tensorflow 2.21.0 (CUDA" \
       "build), CUDA runtime 12.5 and NCCL 2.27 headers, in $((SECONDS - start)) s; not" \
       "run: no GPU)"
)

for line in $lines; do
  case "$line" in
    1) check_tf1 ;;
    2) check_tf2 ;;
    *) echo "usage: $0 [1|2] (the TensorFlow line; both by default)" >&2; exit 2 ;;
  esac
done
