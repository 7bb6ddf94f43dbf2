"""Two launcher agents on localhost pretending to be two nodes (2 ranks each) rendezvous through torch's
c10d rendezvous and write one run dir, which diff reads as one run and finds equal to a one-node run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import DEFAULT, ROOT, cli, last_line

from disttrace.analysis.diff import diff_runs
from disttrace.run.job.launch import free_port
from disttrace.store.rundir import Run

pytestmark = (
    pytest.mark.slow
)  # end-to-end jobs of the full tier (`make test-all`); CI runs `make test`

SETS = [
    "--set",
    "parallelism.dp=4",
    "--set",
    "training.grad_accum_steps=1",
    "--set",
    "training.steps=3",
    "--set",
    "checkpoint.interval=3",
]


def test_two_nodes_one_run_dir(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "disttrace",
                "run",
                DEFAULT,
                *SETS,
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--rdzv-endpoint",
                endpoint,
                "--run-id",
                "t1",
                "--out",
                tmp_path,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    dirs = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(dirs) == 1
    run = Run(dirs.pop())
    assert run.complete and run.ranks() == [0, 1, 2, 3]
    topo = run.topology()
    assert sorted({r.node_rank for r in topo.ranks}) == [0, 1]
    assert sorted(r.local_rank for r in topo.ranks) == [0, 0, 1, 1]
    single = last_line(cli("run", DEFAULT, *SETS, "--out", tmp_path, check=0))
    d = diff_runs(single, run.path)
    assert d.mode == "bitwise" and d.equal


def test_multinode_needs_endpoint_and_run_id(tmp_path):
    proc = cli("run", DEFAULT, "--nnodes", "2", "--out", tmp_path)
    assert proc.returncode == 2 and "--run-id" in proc.stderr


def test_a_second_launcher_on_the_same_run_dir_is_refused(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        sys.executable,
        "-m",
        "disttrace",
        "run",
        DEFAULT,
        *SETS,
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--rdzv-endpoint",
        endpoint,
        "--run-id",
        "dup",
        "--out",
        tmp_path,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        import time

        deadline = time.time() + 60
        while time.time() < deadline and not list(
            tmp_path.glob("*/reference-dup/.launcher-node0.lock")
        ):
            time.sleep(0.05)
        time.sleep(0.5)  # the first launcher holds the lock while it waits for node 1
        second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and "another launcher" in second.stderr, second.stderr[-1000:]
    finally:
        os.killpg(first.pid, 9)
        first.wait(timeout=30)


def test_user_started_torchrun_workers_write_a_complete_run(tmp_path):
    run_dir = last_line(
        cli(
            "run",
            DEFAULT,
            *SETS,
            "--set",
            "parallelism.dp=2",
            "--set",
            "training.grad_accum_steps=2",
            "--prepare-only",
            "--out",
            tmp_path,
            check=0,
        )
    )
    assert not (run_dir / "COMPLETE").exists()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "disttrace.worker",
            "--run-dir",
            str(run_dir),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = Run(run_dir)
    assert run.complete and run.ranks() == [0, 1]
    ours = last_line(
        cli(
            "run",
            DEFAULT,
            *SETS,
            "--set",
            "parallelism.dp=2",
            "--set",
            "training.grad_accum_steps=2",
            "--out",
            tmp_path,
            check=0,
        )
    )
    assert diff_runs(ours, run_dir).equal  # torchrun by hand or our launcher: the same bits
