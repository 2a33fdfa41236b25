#!/usr/bin/env bash
# Creates .venv with autoshard and its test/HF extras. Idempotent; used by the README commands and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch==2.13.0 first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test,hf]" -c scripts/constraints.txt
