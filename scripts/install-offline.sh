#!/usr/bin/env bash
# Install daskllm from a wheelhouse (scripts/wheelhouse.py) on a machine that reaches no
# package index. docs/offline.md.
#
#   scripts/install-offline.sh WHEELHOUSE [VENV]
#       a new virtual environment (default .venv-offline): pip from the wheelhouse first, then
#       daskllm with its extras and every dependency, resolved and checked by pip against the
#       wheelhouse alone (--no-index), then the model package without its dependencies.
#   scripts/install-offline.sh --system-site-packages WHEELHOUSE [VENV]
#       the same in a venv that also sees the system Python's packages: what the wheelhouse left
#       out (--skip torch==...) is taken from there, and pip still checks every dependency.
#   scripts/install-offline.sh --target DIR WHEELHOUSE
#       no venv: every wheel, without dependency checks (pip install --no-deps --target DIR),
#       for the system Python, which keeps its own torch; then use DIR with
#       export PYTHONPATH=DIR:$PYTHONPATH  (and DIR/bin/daskllm, or python -m daskllm.cli).
#
# PYTHON (default python3) is the interpreter used. Ends by importing daskllm from the result.
set -euo pipefail

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

mode=venv
site=
target=
while [[ $# -gt 0 ]]; do
  case $1 in
    --target) [[ $# -ge 2 ]] || usage; mode=target; target=$2; shift 2 ;;
    --target=*) mode=target; target=${1#*=}; shift ;;
    --system-site-packages) site=--system-site-packages; shift ;;
    -h|--help) usage ;;
    -*) echo "install-offline: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[[ $# -ge 1 && $# -le 2 ]] || usage
wheelhouse=$(cd "$1" && pwd)
python=${PYTHON:-python3}
if [[ ! -f $wheelhouse/requirements.txt ]]; then
  echo "install-offline: $wheelhouse/requirements.txt is missing: not a folder made by scripts/wheelhouse.py" >&2
  exit 1
fi
start=$SECONDS

if [[ $mode == target ]]; then
  [[ $# -eq 1 && -z $site ]] || { echo "install-offline: --target takes WHEELHOUSE only" >&2; exit 2; }
  # pip stays the system's: its wheel is for the venv route.
  wheels=()
  for w in "$wheelhouse"/*.whl; do
    [[ $(basename "$w") == pip-* ]] || wheels+=("$w")
  done
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$target" "${wheels[@]}"
  dir=$(cd "$target" && pwd)
  if compgen -G "$wheelhouse/daskllm-*.whl" >/dev/null; then
    version=$(cd / && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" "$python" -c 'import daskllm; print(daskllm.__version__)')
    echo "daskllm $version in $dir ($((SECONDS - start)) s); use it with:"
  else
    echo "installed in $dir ($((SECONDS - start)) s); use it with:"
  fi
  echo "  export PYTHONPATH=$dir\${PYTHONPATH:+:\$PYTHONPATH} PATH=$dir/bin:\$PATH"
  exit 0
fi

venv=${2:-.venv-offline}
"$python" -m venv $site "$venv"
pip=("$venv/bin/python" -m pip)
# The pip a venv bundles can be old (23.2 crashes in its resolver on this dependency set).
if compgen -G "$wheelhouse/pip-*.whl" >/dev/null; then
  "${pip[@]}" install -q --no-index --find-links "$wheelhouse" --upgrade pip
fi
"${pip[@]}" install -q --no-index --find-links "$wheelhouse" -r "$wheelhouse/requirements.txt"
if grep -q '^[^#]' "$wheelhouse/no-deps.txt" 2>/dev/null; then
  "${pip[@]}" install -q --no-index --no-deps --find-links "$wheelhouse" -r "$wheelhouse/no-deps.txt"
fi
if grep -q '^daskllm' "$wheelhouse/requirements.txt"; then
  version=$(cd / && "$venv/bin/python" -c 'import daskllm; print(daskllm.__version__)')
  echo "daskllm $version in $(cd "$venv" && pwd) ($((SECONDS - start)) s): $venv/bin/daskllm"
else
  echo "installed in $(cd "$venv" && pwd) ($((SECONDS - start)) s)"
fi
