#!/usr/bin/env bash
# `make gpu-ops-check`: compile and link EPL's NCCL kernels (csrc/nccl) without a GPU,
# against tensorflow-gpu==1.15.5 and the CUDA runtime (+ nvcc's crt/ headers) and NCCL
# headers and libraries of NVIDIA's pip wheels, in a separate venv (.venv-gpu).  Two
# builds: the mean through ncclAvg (the wheels' NCCL 2.21) and the sum-then-scale path of NCCL < 2.10.
# Nothing is run: TensorFlow 1.15's GPU runtime needs CUDA 10, which no GPU here has.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-gpu
OUT=build/gpu-check
PYBIN=$(tools/find_python.sh 1)
[ -x "$VENV/bin/python" ] || "$PYBIN" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check 'pip<24'
"$VENV/bin/pip" install -q --disable-pip-version-check tensorflow-gpu==1.15.5 'numpy<1.19' \
    'protobuf<3.21' nvidia-cuda-runtime-cu11==11.8.89 nvidia-cuda-nvcc-cu11==11.8.89 \
    nvidia-nccl-cu11==2.21.5
SITE=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
CUDA="$SITE/nvidia/cuda_runtime"
NCCL="$SITE/nvidia/nccl"
mkdir -p "$OUT/lib"
# The wheels ship versioned libraries only: give the linker its plain names.
ln -sf "$CUDA/lib/libcudart.so.11.0" "$OUT/lib/libcudart.so"
ln -sf "$NCCL/lib/libnccl.so.2" "$OUT/lib/libnccl.so"
export TF_CPP_MIN_LOG_LEVEL=2 CUDA_HOME="$CUDA" NCCL_INCLUDE_DIR="$NCCL/include" \
       CUDA_LIB_DIR="$PWD/$OUT/lib" CUDA_EXTRA_INCLUDES="$SITE/nvidia/cuda_nvcc/include"
for variant in avg sum-then-scale; do
  defines=()
  [ "$variant" = sum-then-scale ] && defines=(--define EPL_NCCL_SUM_THEN_SCALE)
  echo "gpu-ops-check: building the NCCL backend ($variant)"
  "$VENV/bin/python" csrc/build.py --require-nccl --out "$OUT/libepl_ops_$variant.so" \
      ${defines[@]+"${defines[@]}"}
  symbols=$(nm -C "$OUT/libepl_ops_$variant.so")
  for kernel in NcclAllReduce NcclAllGather NcclBroadcast NcclReduce NcclReduceScatter \
                NcclAllToAll; do
    grep -qF "epl::(anonymous namespace)::$kernel::Launch" <<< "$symbols" \
      || { echo "gpu-ops-check: $kernel missing from the $variant build" >&2; exit 1; }
  done
done
echo "gpu-ops-check: OK (csrc/nccl compiled and linked against tensorflow-gpu 1.15.5," \
     "CUDA runtime 11.8 and NCCL 2.21 headers; not run: no GPU)"
