#!/usr/bin/env bash
# The README's demo: set up; measure this machine's collectives and compute on 4 local gloo ranks
# into a hardware profile; capture a small GPT-2 (4 layers, hidden 128) on meta tensors, show the
# strategies of one node, solve a plan (strategies + memory decisions) for a 2x2 mesh on the
# measured profile (it shards: the summary's "sharding" line says how much), and train GPT-2 with
# that plan on 4 gloo ranks, failing if any loss differs from single-device training by more than 1e-4 (relative).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out="${TMPDIR:-/tmp}/autoshard-demo"
mkdir -p "$out"
# the README's profile command as written, run in $out (it writes mine.yaml where it runs)
root="$PWD"
(cd "$out" && OMP_NUM_THREADS=1 "$root"/.venv/bin/torchrun --nproc_per_node=4 --standalone -m autoshard.profile \
    --mesh 2x2 --name mine --iters 15 --out mine.yaml)
.venv/bin/autoshard capture gpt2-mini
.venv/bin/autoshard enumerate gpt2-mini --mesh 2x2 --hardware "$out/mine.yaml" --node linear
.venv/bin/autoshard plan gpt2-mini --mesh 2x2 --hardware "$out/mine.yaml" --out "$out/plan.json"
.venv/bin/autoshard explain "$out/plan.json" --plain | head -14
OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=4 --standalone examples/train_gpt2.py \
    --model gpt2-mini --plan "$out/plan.json" --steps 30 --check
