#!/usr/bin/env bash
# For a machine with a GPU (CI stays CPU), in a few minutes:
#  1. what recording costs on the GPU: bench/overhead.py with NCCL, every variant against record.enabled=false
#     (the realistic model; the digests take the batched device path, run/record/devdigest.py);
#  2. the default lab on one GPU with NCCL: a world of 1 (dp=1, accumulation 4 keeps the default's global batch).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
WORLD=${WORLD:-$(python -c "import torch; print(torch.cuda.device_count())")}
python bench/overhead.py --device cuda --world "$WORLD" --steps "${STEPS:-10}" --no-tiny
OUT=${OUT:-runs-gpu}
SETS=(--set parallelism.dp=1 --set training.grad_accum_steps=4)
disttrace run manifests/default.toml "${SETS[@]}" --out "$OUT"
disttrace lab manifests/default.toml "${SETS[@]}" --fault bitflip-param --step 3 --rank 0 \
  --predict optimizer@3:0 --out "$OUT"
REF=$(ls -d "$OUT"/*/reference | head -1)
disttrace show "$REF" memory | tail -5        # peak_allocator: the CUDA allocator's peak
python -c "import json,sys; print(json.load(open('$REF/env.json'))['backend'])"   # expect nccl
