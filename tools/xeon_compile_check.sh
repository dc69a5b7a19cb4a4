#!/usr/bin/env bash
# `make xeon-compile-check`: compile (no link, nothing run) EPL's C++ sources against both
# TensorFlow lines with the instruction sets a current Intel Xeon turns on
# (-march=sapphirerapids: AVX-512 incl. FP16, AMX), so CI on any x86-64 CPU sees what a
# build on such a machine would see (issue 33: `make setup TF=2` with the old build for the
# building CPU failed on Sapphire Rapids).  GCC compiles for a CPU it does not run on.
# Per line:
#   1. the library `make setup` built was compiled for the portable baseline
#      (csrc/build.py's target, in its .json) and that target enables no AVX-512: the real
#      build does not depend on the building CPU;
#   2. csrc/*.cc compile with the build's own flags and -march=sapphirerapids.
#      TF 1.15: as is.  TF 2.x: plus -mno-avx512fp16, because GCC 12 cannot compile
#      TensorFlow 2.21's Eigen headers with AVX-512 FP16 on at all (measured:
#      Eigen/src/Core/arch/AVX512/PacketMathFP16.h:740 "expected initializer before '<'
#      token" in every source that includes TensorFlow, whatever EPL's code).  That FP16
#      path is what (1) keeps out of the real build.
# Needs the lines' venvs (make setup / make setup TF=2).  About a minute per line on 2
# cores (sources compiled in parallel, one per core).
#   tools/xeon_compile_check.sh [1|2]   one line only; both by default
set -euo pipefail
cd "$(dirname "$0")/.."
lines=${1:-"1 2"}
CXX=${CXX:-g++}
jobs=$(nproc 2>/dev/null || echo 2)

check_line() {  # check_line 1|2
  local line=$1 venv out start=$SECONDS defines
  case "$line" in
    1) venv=.venv ;;
    2) venv=.venv-tf2 ;;
    *) echo "usage: $0 [1|2] (the TensorFlow line; both by default)" >&2; exit 2 ;;
  esac
  if [ ! -x "$venv/bin/python" ]; then
    echo "xeon-compile-check: no $venv; run \`make setup TF=$line\` first" >&2
    exit 1
  fi
  export TF_CPP_MIN_LOG_LEVEL=2 TF_ENABLE_ONEDNN_OPTS=0
  # 1. the real build's target, from the library's build info
  local target_flags errors
  errors=$(mktemp)
  # (TensorFlow's import notices go to $errors, shown only when this fails)
  target_flags=$("$venv/bin/python" - 2>"$errors" <<'PY'
import json, os, sys
sys.path.insert(0, "epl/tf_adapter")
import version  # epl/tf_adapter/version.py: the line's library name
info = os.path.join("epl", "lib", os.path.splitext(version.op_library_name())[0] + ".json")
if not os.path.exists(info):
    sys.exit("xeon-compile-check: %s is missing: run make setup" % info)
meta = json.load(open(info))
if "target" not in meta:
    sys.exit("xeon-compile-check: %s records no target (built by an older csrc/build.py): "
             "run make setup" % info)
print(" ".join(meta["target_flags"]))
PY
) || { grep -v "cudart_stub\|absl::InitializeLog" "$errors" >&2; rm -f "$errors"; exit 1; }
  rm -f "$errors"
  defines=$($CXX $target_flags -dM -E -x c++ /dev/null)
  if grep -q '__AVX512' <<< "$defines"; then
    echo "xeon-compile-check: the TF line $line library was built with '$target_flags'," \
         "which enables AVX-512 (not portable; TF 2.21's Eigen fails with FP16)" >&2
    exit 1
  fi
  # 2. the sources, as a Sapphire Rapids would compile them
  local extra=()
  [ "$line" = 2 ] && extra=(--cxxflag=-mno-avx512fp16)
  out=build/xeon-check-tf$line
  rm -rf "$out"
  "$venv/bin/python" csrc/build.py --compile-only "$out" --march sapphirerapids \
      ${extra[@]+"${extra[@]}"} --jobs "$jobs"
  rm -rf "$out"
  local with="-march=sapphirerapids"
  [ "$line" = 2 ] && with="$with -mno-avx512fp16"
  echo "xeon-compile-check: OK (TF line $line: library built for '${target_flags:-the" \
       "compiler default}', no AVX-512; csrc/*.cc compile with $with in" \
       "$((SECONDS - start)) s; nothing linked or run)"
}

for line in $lines; do
  check_line "$line"
done
