"""What zero-code recording costs against an attach call, through the CLI: one user training script (the
realistic LLaMA-style model: dim 512, 4 layers, sequence 256; DDP over 2 ranks on gloo, gradient
accumulation 2 with no_sync, clipping, AdamW) launched three ways, rounds interleaved so machine noise hits
each alike:

  plain       torchrun alone: nothing recorded (the baseline)
  attached    disttrace run -- torchrun ... --attach   (the script calls disttrace.api.attach)
  zero-code   disttrace run -- torchrun ...            (no disttrace line runs in the script)

Each run's rank 0 writes its step times; the first step (set-up, attach's gather) is left out. Prints the
median step time of each way and the ratios zero-code / attached and each / plain.

    python bench/zero_code_overhead.py [--steps 8] [--rounds 3] [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve()


def worker(args) -> None:
    """The user's script: what runs on every rank."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from disttrace.model.llama import build_model, lm_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    cfg = SimpleNamespace(
        dim=512,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=512,
        max_seq_len=256,
        ffn_hidden=1376,
        norm_eps=1e-5,
        rope_theta=10000.0,
    )
    model = DDP(build_model(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = None
    if args.attach:
        import disttrace.api

        run = disttrace.api.attach(model, optimizer, config={"grad_accum_steps": 2})
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        optimizer.zero_grad()
        for mb in range(2):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + mb)
            tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len + 1), generator=g)
            with contextlib.nullcontext() if mb == 1 else model.no_sync():
                loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:]) / 2
                if run is not None:
                    loss = run.loss(loss)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    if run is not None:
        run.close()
    if rank == 0:
        Path(args.times).write_text(json.dumps(times))
    dist.destroy_process_group()


def launch(way: str, steps: int, world: int, out: Path, times: Path) -> list[float]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    script = [torchrun, "--nproc-per-node", str(world), str(HERE), "--worker"]
    script += ["--steps", str(steps), "--times", str(times)]
    if way == "attached":
        script.append("--attach")
    cli = [sys.executable, "-m", "disttrace", "run", "--quiet", "--out", str(out), "--"]
    command = script if way == "plain" else cli + script
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return json.loads(times.read_text())[1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--attach", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--times", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    ways = ("plain", "attached", "zero-code")
    steps: dict[str, list[float]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for way in ways if r % 2 == 0 else reversed(ways):
                times = Path(tmp) / f"{way}-{r}.json"
                steps[way] += launch(way, args.steps, args.world, Path(tmp) / "runs", times)
    med = {w: statistics.median(steps[w]) for w in ways}
    print(
        f"workload: dim 512, 4 layers, seq 256, DDP x {args.world} ranks (gloo), accumulation 2, "
        f"{args.steps - 1} timed steps x {args.rounds} rounds a way"
    )
    for w in ways:
        print(f"  {w:10s} median step {med[w]:.3f} s  ({med[w] / med['plain']:.3f}x plain)")
    print(f"zero-code / attached: {med['zero-code'] / med['attached']:.3f}x")


if __name__ == "__main__":
    main()
