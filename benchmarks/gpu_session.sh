#!/usr/bin/env bash
# One device call that runs every GPU check in turn, each under its own time limit, so that a
# check that runs long or fails leaves the others' results: the versions and the GPU, the CUDA
# meter's test, a quickstart run on the GPU, `gpu_compare.sh` (short) and `gpu_finer_plans.sh`
# (the middle budget). Everything it prints and the run directories' records (no weights) end up
# in OUT_DIR (a log per check and records.tgz).
#
#   benchmarks/gpu_session.sh [OUT_DIR]            (default runs/gpu_session)
#   STEPS=40 COMPARE_S=240 FINER_S=120 benchmarks/gpu_session.sh "$OUT"
#   CHECKS="versions compare" RECIPES=mc_roberta benchmarks/gpu_session.sh "$OUT/a"   (some checks)
#   DEVICE=cpu STEPS=4 RECIPES=quickstart BUDGETS=40MB FINER_RECIPE=recipes/quickstart.yaml \
#       benchmarks/gpu_session.sh /tmp/gpu_dry     (a dry run of the script on the CPU)
#
# Where the machine has no package index, wheels for what it lacks can lie in .whl/ (pydantic,
# the transformers release of pyproject.toml); they are installed into /tmp/site first (WHEELS=no
# skips them).
set -uo pipefail

OUT_DIR="${1:-runs/gpu_session}"
DEVICE="${DEVICE:-cuda}"
STEPS="${STEPS:-40}"
COMPARE_S="${COMPARE_S:-240}"
FINER_S="${FINER_S:-120}"
CHECKS=" ${CHECKS:-versions cuda_tests quickstart compare finer_plans} "
export RECIPES="${RECIPES:-mc_roberta qa_bert}"
export BUDGETS="${BUDGETS:-4GB,6GB,8GB}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 COLUMNS=180

cd "$(dirname "$0")/.."
mkdir -p "$OUT_DIR"
RUNS="$(mktemp -d)"

if [ "${WHEELS:-yes}" = yes ] && compgen -G ".whl/*.whl" > /dev/null; then
    if [ ! -d /tmp/site/pydantic ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || exit 1
    fi
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
# The console script without installing the package: the checkout is on PYTHONPATH.
mkdir -p /tmp/mimose-bin
printf '#!/bin/sh\nexec python3 -m mimose_cli "$@"\n' > /tmp/mimose-bin/mimose
chmod +x /tmp/mimose-bin/mimose
export PATH="/tmp/mimose-bin:$PATH"

check() {  # check NAME SECONDS COMMAND...: run one check under its limit, its output to NAME.log
    local name="$1" limit="$2"
    shift 2
    [[ "$CHECKS" == *" $name "* ]] || return 0
    echo "== ${name} (limit ${limit} s) =="
    local start=$SECONDS
    timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT_DIR/${name}.log"
    echo "== ${name}: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s =="
}

check versions 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true;
    python3 -c "import torch, transformers, pydantic; print(\"torch\", torch.__version__, \"transformers\",
transformers.__version__, \"pydantic\", pydantic.VERSION); print(torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\")"
    python3 -c "from mimose_cli.launcher.step import resolve_device; import torch; d = resolve_device(\"auto\"); x = torch.ones(1, device=d);
print(\"expandable segments:\", d.type == \"cuda\" and any(s.get(\"is_expandable\") for s in torch.cuda.memory._snapshot()[\"segments\"]))"'
if [ "$DEVICE" = cuda ]; then  # the CUDA meter's own tests
    check cuda_tests 90 python3 -m pytest -q -p no:cacheprovider tests/memory/test_simulated.py -k cuda
fi
check quickstart 90 mimose train recipes/quickstart.yaml "device=$DEVICE" --out "$RUNS/quickstart"
check compare "$COMPARE_S" env "DEVICE=$DEVICE" REPEATS=1 benchmarks/gpu_compare.sh "$STEPS" "$RUNS/compare"
check finer_plans "$FINER_S" env "DEVICE=$DEVICE" RECIPE="${FINER_RECIPE:-recipes/mc_roberta.yaml}" \
    FRACTIONS=0.35 REPEATS=1 benchmarks/gpu_finer_plans.sh "$STEPS" "$RUNS/finer_plans"

# The records, not the weights: the run directories' JSON and text files.
tar -czf "$OUT_DIR/records.tgz" -C "$RUNS" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.png' .
ls -la "$OUT_DIR"
