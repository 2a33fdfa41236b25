#!/usr/bin/env bash
# The README's test command: set up, unit tests on 2 workers, then the distributed suite in ONE
# torchrun launch (4 gloo ranks, every rank runs pytest). Fails if either fails or collects nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m pytest -n 2 tests --ignore=tests/distributed "$@"
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=4 --standalone \
    -m pytest tests/distributed -p no:cacheprovider -q
