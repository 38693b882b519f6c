#!/usr/bin/env bash
# Finer plans where the matmuls dominate: block-level Mimose against Mimose with finer plans
# (`mimose:selective`), with offload among them (`mimose:offload`: the copies over PCIe, their
# cost timed before the first step) and the oracle over each choice set, on a real GPU, at three budgets between
# what the recipe needs with every block checkpointed and without checkpointing (by default 5 %, 35 %, 85 % of
# the way, as benchmarks/finer_plans.py and paper_figure.py place them). `mimose compare` prints one
# table per budget; the "blocks" column says how many blocks per step were checkpointed and how many
# of them selectively (and offloaded), "recompute" what their recomputation took.
#
#   benchmarks/gpu_finer_plans.sh [STEPS] [OUT_DIR]   (defaults: 60 steps, runs/gpu_finer_plans)
#   RECIPE=recipes/qa_bert.yaml REPEATS=3 benchmarks/gpu_finer_plans.sh
#   DEVICE=cpu RECIPE=recipes/quickstart.yaml benchmarks/gpu_finer_plans.sh 10   (a dry run of the script)
#   FRACTIONS=0.35 REPEATS=1 benchmarks/gpu_finer_plans.sh 30   (the middle budget alone: one short device call)
#
# Needs a CUDA GPU (DEVICE=cuda, the default). Writes OUT_DIR/compare.json with the run directories
# (`mimose report OUT_DIR` renders them again) and the tables to OUT_DIR.txt.
set -euo pipefail

STEPS="${1:-60}"
OUT="${2:-runs/gpu_finer_plans}"
RECIPE="${RECIPE:-recipes/mc_roberta.yaml}"
DEVICE="${DEVICE:-cuda}"
REPEATS="${REPEATS:-3}"
FRACTIONS="${FRACTIONS:-0.05,0.35,0.85}"

cd "$(dirname "$0")/.."
if [ "$DEVICE" = cuda ]; then
    python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible")'
fi

# The two figures of the pre-flight (the largest input, every block checkpointed / none), then
# the budgets between them.
BUDGETS="$(python3 - "$RECIPE" "$DEVICE" "$FRACTIONS" <<'EOF'
import sys

from rich.console import Console

from mimose_cli.launcher.recipe import load_recipe
from mimose_cli.launcher.train import dry_run

recipe = load_recipe(sys.argv[1], [f"device={sys.argv[2]}", "budget=null"])
needs = dry_run(recipe, console=Console(stderr=True))
if needs.full_bytes is None or needs.none_bytes is None:
    sys.exit("the pre-flight could not measure the recipe's largest step on this device")
full, none = needs.full_bytes, needs.none_bytes
print(",".join(str(int(full + float(f) * (none - full))) for f in sys.argv[3].split(",")))
EOF
)"
echo "budgets (bytes): $BUDGETS"

COLUMNS=180 mimose compare "$RECIPE" \
    --baselines mimose:selective,mimose:offload,oracle:selective,oracle:offload --budgets "$BUDGETS" --steps "$STEPS" --repeats "$REPEATS" \
    --out "$OUT" "device=$DEVICE" | tee "$OUT.txt"
