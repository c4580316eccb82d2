#!/usr/bin/env bash
# The main job: set up, build, and run the benchmark (GPU when there is one, else CPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup_env.sh
python -m dmattn.bench "$@"
