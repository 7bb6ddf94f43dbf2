#!/usr/bin/env bash
# For a machine with a GPU (CI stays CPU): the default lab on one GPU with NCCL, in a few minutes.
# A world of 1 (dp=1, accumulation 4 keeps the global batch of the default) so one GPU suffices.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
OUT=${OUT:-runs-gpu}
SETS=(--set parallelism.dp=1 --set training.grad_accum_steps=4)
disttrace run manifests/default.toml "${SETS[@]}" --out "$OUT"
disttrace lab manifests/default.toml "${SETS[@]}" --fault bitflip-param --step 3 --rank 0 \
  --predict optimizer@3:0 --out "$OUT"
REF=$(ls -d "$OUT"/*/reference | head -1)
disttrace show "$REF" memory | tail -5        # peak_allocator: the CUDA allocator's peak
python -c "import json,sys; print(json.load(open('$REF/env.json'))['backend'])"   # expect nccl
