#!/usr/bin/env bash
# The README's test command: set up, unit tests on 2 workers, then the distributed suite in ONE
# torchrun launch (4 gloo ranks, every rank runs pytest; output from rank 0). Fails if either fails or
# collects nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m pytest -n 2 tests --ignore=tests/distributed "$@"
# Rank 0 prints the output, then the failing tests and tracebacks of any other rank; ranks 1-3 write
# theirs to $logs/rank<N>.log. If the launch fails, the end of the log of every rank that did not
# finish its session (crashed, or stopped by torchrun when another rank died) is printed too.
logs="${AUTOSHARD_DIST_LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/autoshard-distributed.XXXXXX")}"
if ! AUTOSHARD_DIST_LOG_DIR="$logs" OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node=4 --standalone \
    -m pytest tests/distributed -p no:cacheprovider -q; then
    for log in "$logs"/rank*.log; do
        [ -e "$log" ] && [ ! -e "${log%.log}.report.json" ] || continue
        echo "== $log: that rank did not finish its session; its last 30 lines:"
        tail -n 30 "$log"
    done
    exit 1
fi
