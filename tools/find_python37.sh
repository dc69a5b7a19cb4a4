#!/usr/bin/env bash
# Print the path of a Python 3.7 interpreter, or explain how to get one.
# Order: $EPL_PYTHON, python3.7 on PATH, pyenv's 3.7.x installs.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 7) else 1)' >/dev/null 2>&1; }
if [ -n "${EPL_PYTHON:-}" ]; then
  if ok "$EPL_PYTHON"; then echo "$EPL_PYTHON"; exit 0; fi
  echo "EPL_PYTHON=$EPL_PYTHON is not a working Python 3.7" >&2; exit 1
fi
if command -v python3.7 >/dev/null 2>&1 && ok "$(command -v python3.7)"; then
  command -v python3.7; exit 0
fi
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for p in "$root"/versions/3.7*/bin/python3.7; do
    if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
  done
fi
for p in "$HOME"/.pyenv/versions/3.7*/bin/python3.7 /usr/local/bin/python3.7 /usr/bin/python3.7; do
  if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
done
cat >&2 <<'MSG'
EPL needs Python 3.7 (TensorFlow 1.15 has no wheels for newer Pythons) and none was found.
Install one, for example:
    pyenv install 3.7.16          # then re-run make
or point EPL_PYTHON at an interpreter:
    make setup EPL_PYTHON=/path/to/python3.7
MSG
exit 1
