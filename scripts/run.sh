#!/usr/bin/env bash
# The main job: set up, build, and run the benchmark (GPU when there is one, else the CPU).
# Arguments go to `python -m dmattn.bench` (e.g. --suite dense,topk, --quick, --out DIR); the
# table, results.json and the plots land in the folder named at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup_env.sh
echo "[run] benchmarking dmattn against its peers on this machine"
python -m dmattn.bench "$@"
