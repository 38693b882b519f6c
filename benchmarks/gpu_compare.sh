#!/usr/bin/env bash
# The paper's four tasks at 4-8 GB on a real GPU: `mimose compare` runs mimose, Sublinear, DTR,
# none and oracle on the same data order and seed at each budget and prints one table per budget.
#
#   benchmarks/gpu_compare.sh [STEPS] [OUT_DIR]     (defaults: 200 steps, runs/gpu_compare)
#   REPEATS=3 benchmarks/gpu_compare.sh              (median of 3 rotated rounds; default 1)
#   RECIPES="mc_roberta qa_bert" BUDGETS=4GB,6GB,8GB benchmarks/gpu_compare.sh 40   (a shorter call)
#   DEVICE=cpu RECIPES=quickstart BUDGETS=40MB benchmarks/gpu_compare.sh 5   (a dry run of the script)
#
# Needs a CUDA GPU with at least 8 GB free; each recipe writes OUT_DIR/<recipe>/compare.json and
# its run directories (`mimose report OUT_DIR/<recipe>` renders them again). Tables also go to
# OUT_DIR/<recipe>.txt.
set -euo pipefail

STEPS="${1:-200}"
OUT="${2:-runs/gpu_compare}"
BUDGETS="${BUDGETS:-4GB,5GB,6GB,7GB,8GB}"
REPEATS="${REPEATS:-1}"
read -r -a RECIPES <<< "${RECIPES:-mc_roberta qa_xlnet qa_bert tc_bert}"
DEVICE="${DEVICE:-cuda}"

cd "$(dirname "$0")/.."
if [ "$DEVICE" = cuda ]; then
    python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible")'
fi
mkdir -p "$OUT"

for name in "${RECIPES[@]}"; do
    echo "== ${name} =="
    # COLUMNS keeps the tables readable when the output goes to a file.
    COLUMNS=160 mimose compare "recipes/${name}.yaml" \
        --baselines sublinear,dtr --budgets "$BUDGETS" --steps "$STEPS" --repeats "$REPEATS" \
        --out "$OUT/$name" "device=$DEVICE" | tee "$OUT/${name}.txt"
done
echo "compare directories: $OUT/{$(IFS=,; echo "${RECIPES[*]}")}"
