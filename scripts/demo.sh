#!/usr/bin/env bash
# The README's demo: set up, capture GPT-2 (tiny config) on meta tensors, enumerate its sharding
# strategies on a 2x2 mesh, then measure this machine's collectives on 4 local gloo ranks.
# (Planning and training land with the solver and runtime issues; see README "Status".)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/autoshard capture gpt2-tiny
.venv/bin/autoshard enumerate gpt2-tiny --mesh 2x2 --hardware cpu-gloo --node linear
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=4 --standalone -m autoshard.profile \
    --mesh 2x2 --name demo-measured --out "${TMPDIR:-/tmp}/autoshard-demo-profile.yaml"
