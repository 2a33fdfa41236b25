#!/usr/bin/env bash
# The README's demo: set up; measure this machine's collectives on 4 local gloo ranks into a
# hardware profile; capture GPT-2 (tiny config) on meta tensors, show the strategies of one node,
# solve a plan (strategies + memory decisions) for a 2x2 mesh on the measured profile, and train
# GPT-2 with that plan on 4 gloo ranks, checking every loss against single-device training.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out="${TMPDIR:-/tmp}/autoshard-demo"
mkdir -p "$out"
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=4 --standalone -m autoshard.profile \
    --mesh 2x2 --name demo-measured --out "$out/profile.yaml"
.venv/bin/autoshard capture gpt2-tiny
.venv/bin/autoshard enumerate gpt2-tiny --mesh 2x2 --hardware "$out/profile.yaml" --node linear
.venv/bin/autoshard plan gpt2-tiny --mesh 2x2 --batch 8 --hardware "$out/profile.yaml" --budget 1MiB \
    --out "$out/plan.json"
.venv/bin/autoshard explain "$out/plan.json" --plain | head -12
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=4 --standalone examples/train_gpt2.py \
    --plan "$out/plan.json" --steps 30 --check
