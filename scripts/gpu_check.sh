#!/usr/bin/env bash
# The GPU check (scripts/gpu_check/): a PASS/FAIL line per check, the figures as JSON (--out, default
# gpu_check.json). `--dry-run` runs the same code on CPU at tiny shapes. Needs no vLLM; see the README, "GPU check".
#
#   bash scripts/gpu_check.sh [--out gpu_check.json] [--only loss,transport]
#   bash scripts/gpu_check.sh --dry-run
#
# Python: $PYTHON, else this clone's .venv, else python3 (a GPU box with torch but no venv of ours).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
# apmpo and the check (scripts/gpu_check/) are imported from this clone, apmpo installed or not.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" -m scripts.gpu_check "$@"
