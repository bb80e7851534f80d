#!/usr/bin/env bash
# The first run on a GPU, as one command (bench/gpu_check.py says what it runs): on a machine with
# a CUDA build of torch and no network, nothing to install; at most 8 minutes on one GPU.
#
#   bash bench/gpu_check.sh                    # from anywhere; PY=python3.11 to choose the interpreter
#   LLAMA_LAYERS=8 bash bench/gpu_check.sh --only llama8b
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec timeout "${LIMIT_S:-480}" "$PY" bench/gpu_check.py "$@"
