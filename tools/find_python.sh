#!/usr/bin/env bash
# Print the path of a Python interpreter for one TensorFlow line, or explain how to get one.
#   tools/find_python.sh 1   a Python 3.7 (TensorFlow 1.15.5 has wheels for 3.7 only)
#   tools/find_python.sh 2   the newest Python 3.11 - 3.13 found (TensorFlow 2.21)
#   tools/find_python.sh 2.15   a Python 3.11 (TensorFlow 2.15 with the Estimator; its newest
#                               wheels are for 3.9 - 3.11, and EPL's TF 2.x line needs 3.11)
# Order: $EPL_PYTHON, pythonX.Y on PATH, pyenv's installs, the usual prefixes; for line 2
# the newest version wins.
set -u
line=${1:-1}
case "$line" in
  1) versions="3.7" ;;
  2) versions="3.13 3.12 3.11" ;;
  2.15) versions="3.11" ;;
  *) echo "usage: $0 1|2|2.15 (the TensorFlow line)" >&2; exit 2 ;;
esac
ok() {  # ok PYTHON VERSION: the interpreter runs and is that version
  "$1" -c "import sys; sys.exit(0 if '%d.%d' % sys.version_info[:2] == '$2' else 1)" \
    >/dev/null 2>&1
}
if [ -n "${EPL_PYTHON:-}" ]; then
  for v in $versions; do
    if ok "$EPL_PYTHON" "$v"; then echo "$EPL_PYTHON"; exit 0; fi
  done
  echo "EPL_PYTHON=$EPL_PYTHON is not a working Python $versions (TensorFlow line $line)" >&2
  exit 1
fi
root=""
if command -v pyenv >/dev/null 2>&1; then root=$(pyenv root 2>/dev/null); fi
for v in $versions; do
  candidates=()
  if command -v "python$v" >/dev/null 2>&1; then candidates+=("$(command -v "python$v")"); fi
  if [ -n "$root" ]; then candidates+=("$root"/versions/"$v".*/bin/python"$v"); fi
  candidates+=("$HOME"/.pyenv/versions/"$v".*/bin/python"$v" /usr/local/bin/python"$v" /usr/bin/python"$v")
  for p in "${candidates[@]}"; do
    if [ -x "$p" ] && ok "$p" "$v"; then echo "$p"; exit 0; fi
  done
done
if [ "$line" = 1 ]; then
  cat >&2 <<'MSG'
EPL's TensorFlow 1.15 line needs Python 3.7 (TensorFlow 1.15 has no wheels for newer
Pythons) and none was found.  Either install one, for example
    pyenv install 3.7.16          # then re-run make
or point EPL_PYTHON at one:  make setup EPL_PYTHON=/path/to/python3.7
or use the TensorFlow 2.x line (Python 3.11 - 3.13):  make setup TF=2
MSG
elif [ "$line" = 2.15 ]; then
  cat >&2 <<'MSG'
EPL's TensorFlow 2.15 line (the Estimator on TF 2.x) needs Python 3.11 (TensorFlow 2.15 has
no wheels for newer Pythons) and none was found.  Install one (Debian: apt-get install
python3.11 python3.11-venv; or pyenv install 3.11) and re-run make, or point EPL_PYTHON at
one:  make setup TF=2.15 EPL_PYTHON=/path/to/python3.11
MSG
else
  cat >&2 <<'MSG'
EPL's TensorFlow 2.x line needs Python 3.11, 3.12 or 3.13 (TensorFlow 2.21's wheels) and
none was found.  Install one (Debian: apt-get install python3.11 python3.11-venv; or
pyenv install 3.12) and re-run make, or point EPL_PYTHON at one:
    make setup TF=2 EPL_PYTHON=/path/to/python3.12
MSG
fi
exit 1
