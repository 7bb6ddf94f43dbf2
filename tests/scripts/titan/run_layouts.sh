#!/usr/bin/env bash
# torchtitan's llama3 debug model on CPU/gloo: one seed checkpoint, then 5 steps at dp=1, FSDP 2
# and TP 2 from it; prints each layout's losses at full precision and the largest difference.
#
#   tests/scripts/titan/run_layouts.sh [OUT_DIR]     (PY=/path/to/venv/bin/python to choose torch)
#
# Each run is a torchrun of titan_train.py (torchtitan's `python -m torchtitan.train` with the
# CPU shims); nothing here imports disttrace.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PY:-/work/titan-venv/bin/python}"
OUT="$(mkdir -p "${1:-/tmp/titan-layouts}" && cd "${1:-/tmp/titan-layouts}" && pwd)"
export OMP_NUM_THREADS=1
cd "$OUT"
rm -rf seed one fsdp tp ./*.jsonl ./*.log

COMMON=(
    --module llama3 --config llama3_debugmodel
    --parallelism.spmd-backend partial_dtensor
    --hf-assets-path "$HERE/assets/tokenizer"
    --dataloader.dataset-path "$HERE/assets/c4_test"
    --training.seq-len 256 --training.local-batch-size 2 --training.steps 5
    --training.mixed-precision-param float32
    --validator.no-enable --debug.seed 42
)
LOAD=(--checkpoint.enable --checkpoint.initial-load-path "$OUT/seed/checkpoint/step-0" --checkpoint.load-only)

run() { # name nproc args...
    local name=$1 nproc=$2
    shift 2
    local t0=$SECONDS
    TITAN_LOSSES="$OUT/$name.jsonl" "$PY" -m torch.distributed.run --nproc-per-node "$nproc" \
        "$HERE/titan_train.py" "${COMMON[@]}" --dump-folder "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1 \
        || { echo "$name failed, see $OUT/$name.log" >&2; tail -20 "$OUT/$name.log" >&2; exit 1; }
    echo "$name: $((SECONDS - t0)) s"
}

run seed 1 --checkpoint.enable --checkpoint.create-seed-checkpoint
run one 1 "${LOAD[@]}"
run fsdp 2 "${LOAD[@]}" --parallelism.data-parallel-shard-degree 2
run tp 2 "${LOAD[@]}" --parallelism.tensor-parallel-degree 2

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {n: [json.loads(l) for l in (out / f"{n}.jsonl").read_text().splitlines()] for n in ("one", "fsdp", "tp")}
print(f"{'step':>4} " + " ".join(f"{n:>22}" for n in runs))
worst = 0.0
for i, row in enumerate(runs["one"]):
    losses = [runs[n][i]["loss"] for n in runs]
    worst = max(worst, max(abs(x - losses[0]) for x in losses))
    print(f"{row['step']:>4} " + " ".join(f"{x:>22.17g}" for x in losses))
print(f"max |loss - loss(dp=1)| over steps and layouts: {worst:.3g}")
EOF
