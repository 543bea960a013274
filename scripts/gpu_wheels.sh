#!/usr/bin/env bash
# One folder of wheels that makes every check of scripts/gpu_check.sh runnable on a GPU machine with its own torch
# and no network: DeepSpeed (built here: PyPI has no wheel of it) and, as wheels for that machine's Python and
# platform (manylinux x86_64), everything else the checks import and all it requires, at this clone's .venv
# versions (scripts/gpu_wheels.txt, closed over by scripts/gpu_wheels.py; torch and its requirements stay the
# machine's). Run it where pip reaches PyPI:
#
#   bash scripts/gpu_wheels.sh [OUT_DIR (default wheels/)] [--python-version 3.12]
#
# Carry OUT_DIR to the GPU machine, then there:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels/*.whl
#   PYTHONPATH=/tmp/site PYTHON=python3 bash scripts/gpu_check.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
out="$root/wheels"
python_version=3.12
while (($#)); do
  case "$1" in
    --python-version) python_version="$2"; shift 2 ;;
    *) out="$1"; shift ;;
  esac
done
mkdir -p "$out"
# pip matches a manylinux tag exactly: name every glibc level a wheel of these may carry.
platforms=()
for tag in manylinux1 manylinux2010 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
           manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done
pins=$("$python" "$root/scripts/gpu_wheels.py" --python-version "$python_version")
for pin in $pins; do
  if [[ "$pin" == deepspeed==* ]]; then  # pure Python (its ops compile on first use), but only an sdist on PyPI
    "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$pin"
  else
    "$python" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
      --python-version "$python_version" "${platforms[@]}" -d "$out" "$pin"
  fi
done
echo "$(ls "$out"/*.whl | wc -l) wheels in $out for CPython $python_version, manylinux x86_64"
