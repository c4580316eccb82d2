#!/usr/bin/env bash
# The main job: set up, build, and run the benchmark (GPU when there is one, else the CPU).
# Arguments go to `python -m dmattn.bench` (e.g. --suite dense,topk, --quick, --out DIR); the
# table, results.json and the plots land in the folder named at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup_env.sh
echo "[run] benchmarking dmattn against its peers on this machine"
python -m dmattn.bench "$@"
# On a GPU with transformers installed: Doge's per-query top-k and the transformers Doge
# training step beside sdpa / eager (dmattn.bench.doge).
if python -c "import torch, transformers; raise SystemExit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "[run] Doge: per-query causal top-k and one DogeForCausalLM training step (dmattn.bench.doge)"
  mkdir -p bench-results
  python -m dmattn.bench.doge --json bench-results/doge.json
  echo "[run] Doge figures in bench-results/doge.json"
fi
