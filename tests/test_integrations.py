"""disttrace inside real training libraries: a transformers.Trainer and a Lightning Trainer, each a
2-process CPU/gloo DDP run of a tiny model with gradient accumulation, recorded through a callback. `make
test` installs the extras (disttrace[hf], disttrace[lightning]); a skip here means that install was impossible."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from conftest import ROOT, cli

from disttrace.analysis.diff import diff_runs
from disttrace.store.rundir import Run

pytestmark = (
    pytest.mark.slow
)  # end-to-end jobs of the full tier (`make test-all`); CI runs `make test`

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"


def torchrun(script: str, *args) -> Path:
    proc = subprocess.run(
        [
            TORCHRUN,
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "scripts" / script),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def phases_of_step(run: Path, step: int) -> set[tuple[int, str]]:
    return {(r["micro_batch"], r["phase"]) for r in Run(run).records(0) if r["step"] == step}


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    pytest.importorskip(
        "transformers",
        reason="transformers could not be installed here (make test installs "
        "disttrace[hf]); the Trainer integration is untested on this machine",
    )
    out = tmp_path_factory.mktemp("hf")
    return (
        torchrun("hf_train.py", out, 2, 4),
        torchrun("hf_train.py", out, 1, 8),
        torchrun("hf_train.py", out, 2, 4, "mean-per-micro-batch"),
    )


def test_hf_trainer_run_is_recorded_with_its_accumulation(hf_runs):
    accum2 = hf_runs[0]
    run = Run(accum2)
    assert run.complete and run.manifest_doc["parallelism"]["engine"] == "DDP"
    assert (
        run.manifest_doc["training"]["grad_accum_steps"] == 2
        and run.manifest_doc["config"]["learning_rate"] == 1e-2
    )
    seen = phases_of_step(accum2, 2)
    assert {
        (0, "backward"),
        (1, "backward"),
        (1, "reduce"),
        (1, "clip"),
        (1, "optimizer"),
    } <= seen, seen
    assert (0, "reduce") not in seen  # DDP reduces after the last micro-batch only
    assert cli("check", accum2).returncode == 0


def test_hf_accumulation_2x4_equals_1x8_numerically(hf_runs):
    """The same global batch (2 ranks x 8 sequences per step), split in two micro-batches or not. Padded
    sequences make per-micro-batch token counts differ: a per-micro-batch mean would diverge
    (https://github.com/huggingface/transformers/pull/34191);
    the Trainer's normalisation by the step's token count keeps them equivalent within the derived bound."""
    d = diff_runs(*hf_runs[:2])
    assert d.mode == "numeric" and d.compared_steps.count == 3
    assert d.equal, d.first_divergence
    assert {"reduce", "optimizer"} <= set(d.compared_phases)


def test_hf_per_micro_batch_mean_is_not_equivalent(hf_runs):
    """The negative control: the same 2 x 4 run with each micro-batch's loss its own token mean / 2 (the
    Trainer told the model takes no loss kwargs: the normalisation transformers pull request 34191 fixed)
    must diverge from 1 x 8 at the first reduced gradient, and from the correct 2 x 4 bit for bit at the
    first micro-batch's local gradient."""
    accum2, accum1, per_mb_mean = hf_runs
    d = diff_runs(accum1, per_mb_mean)
    assert d.mode == "numeric" and not d.equal
    f = d.first_divergence
    assert (f.step, f.phase) == (1, "reduce"), f
    f = diff_runs(accum2, per_mb_mean).first_divergence
    assert (f.step, f.micro_batch, f.phase) == (1, 0, "backward"), f


def test_lightning_run_is_recorded_with_its_accumulation(tmp_path):
    pytest.importorskip(
        "lightning",
        reason="lightning could not be installed here (make test installs "
        "disttrace[lightning]); the Lightning integration is untested here",
    )
    run_dir = torchrun("lightning_train.py", tmp_path)
    run = Run(run_dir)
    assert (
        run.complete
        and run.manifest_doc["parallelism"]["engine"] == "DDP"
        and run.ranks() == [0, 1]
    )
    for step in (
        1,
        2,
        3,
    ):  # accumulate_grad_batches=2: two forwards per optimizer step, the reduce after the last
        seen = phases_of_step(run_dir, step)
        assert {
            (0, "data"),
            (0, "backward"),
            (1, "backward"),
            (1, "reduce"),
            (1, "clip"),
            (1, "optimizer"),
        } <= seen
        assert (0, "reduce") not in seen, seen
    assert cli("check", run_dir).returncode == 0


@pytest.fixture(scope="module")
def lightning_pairs(tmp_path_factory):
    pytest.importorskip("lightning", reason="lightning could not be installed here")
    out = tmp_path_factory.mktemp("lightning-pairs")
    return {
        "2x4": torchrun("lightning_train.py", out, 2, 4),
        "1x8": torchrun("lightning_train.py", out, 1, 8),
        "1x8-skew": torchrun("lightning_train.py", out, 1, 8, "skew-lr"),
        "1x16": torchrun("lightning_train.py", out, 1, 16),
    }


def test_lightning_accumulation_2x4_is_one_experiment_with_1x8(lightning_pairs):
    """strategy="ddp" on 2 ranks: accumulate 2 x batch 4 and 1 x 8 train on the same 16 samples a step. The
    callback states no batch size; the run counted it (16 both), so diff compares them, numerically equal
    (exit 0). The control that must diverge: rank 1's learning rate off by 1e-3 relative (the manifest, rank
    0's, cannot show it). 1 x 16 (32 a step) is another experiment."""
    for name in ("2x4", "1x8"):
        assert Run(lightning_pairs[name]).lock["observed"]["global_batch"] == 16
    proc = cli("diff", lightning_pairs["2x4"], lightning_pairs["1x8"], "--mode", "numeric")
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = diff_runs(lightning_pairs["2x4"], lightning_pairs["1x8"], mode="numeric")
    assert d.equal and d.compared_steps.count == 3 and not d.topology.same
    # the control: same global batch, so compared; it shows first where the learning rate is recorded,
    # step 1's clip scalars
    control = diff_runs(lightning_pairs["2x4"], lightning_pairs["1x8-skew"], mode="numeric")
    f = control.first_divergence
    assert not control.equal and (f.step, f.phase, f.tensor) == (1, "clip", "lr"), f
    proc = cli("diff", lightning_pairs["2x4"], lightning_pairs["1x16"], "--mode", "numeric")
    assert proc.returncode == 2 and "global_batch 16 vs 32" in proc.stderr, proc.stderr


# ---------------------------------------------------------------- sample ids through the callbacks
# The oracle is the data itself: every item carries its own index, and the model (HF) or training_step
# (Lightning) logs per training forward the indices it was handed and the optimizer step it belongs to
# (LOG/rank{R}.jsonl). Each rank's data records, in order, must carry exactly those ids, or none where the
# sampler cannot be read ahead (never other ids).


def id_runs(
    script: str, out: Path, variants: tuple[str, ...]
) -> dict[str, tuple[Path, dict[int, list]]]:
    runs = {}
    for variant in variants:
        log = out / f"log-{variant or 'default'}"
        log.mkdir()
        run = torchrun(script, out, log, *([variant] if variant else []))
        runs[variant] = (
            run,
            {
                rank: [
                    (d["step"], d["idx"])
                    for d in map(
                        orjson.loads, (log / f"rank{rank}.jsonl").read_bytes().splitlines()
                    )
                ]
                for rank in (0, 1)
            },
        )
    return runs


def data_ids(run: Path, rank: int) -> list[tuple[int, list[int]]]:
    return [(r["step"], r["samples"]) for r in Run(run).records(rank) if r["phase"] == "data"]


@pytest.fixture(scope="module")
def hf_id_runs(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers could not be installed here")
    return id_runs("hf_sample_ids.py", tmp_path_factory.mktemp("hf-ids"), ("", "unseeded", "twice"))


@pytest.fixture(scope="module")
def lightning_id_runs(tmp_path_factory):
    pytest.importorskip("lightning", reason="lightning could not be installed here")
    return id_runs(
        "lightning_sample_ids.py",
        tmp_path_factory.mktemp("lightning-ids"),
        ("", "self-call", "random"),
    )


def test_hf_data_records_carry_the_ids_each_forward_received(hf_id_runs):
    """The Trainer's default sampler (accelerate's SeedableRandomSampler, sharded by BatchSamplerShard), over
    two epochs (4 steps of windows 2, 1, 2, 1 micro-batches): every micro-batch's ids, on both ranks."""
    run, logged = hf_id_runs[""]
    for rank in (0, 1):
        assert [s for s, _ in logged[rank]] == [1, 1, 2, 3, 3, 4]
        assert data_ids(run, rank) == logged[rank]
    assert {i for _, ids in logged[0][:3] for i in ids}.isdisjoint(
        i for _, ids in logged[1][:3] for i in ids
    )
    assert (
        logged[0][:3] != logged[0][3:]
    )  # the second epoch is reshuffled: a stale epoch would not match


def test_hf_unreadable_sampler_records_no_ids(hf_id_runs):
    """use_seedable_sampler=False: a RandomSampler whose generator accelerate synchronises as each epoch starts
    cannot be read ahead: the data records are there, without ids."""
    run, logged = hf_id_runs["unseeded"]
    for rank in (0, 1):
        assert [(s, []) for s, _ in logged[rank]] == data_ids(run, rank)


def test_hf_two_forwards_per_batch_never_record_another_batchs_ids(hf_id_runs):
    """compute_loss runs the model twice on each batch. Counting forwards, the second would take the next
    batch's ids (it did, before the callback checked that a forward reads the batch it is paired with);
    now the batch after a mismatch loses its ids, and every id recorded is the forward's own."""
    run, logged = hf_id_runs["twice"]
    for rank in (0, 1):
        records = data_ids(run, rank)
        assert len(records) == len(logged[rank]) == 12
        assert all(
            ids in ([], seen) and step == at
            for (step, ids), (at, seen) in zip(records, logged[rank])
        )
        assert [i for i, (_, ids) in enumerate(records) if ids] == [
            0,
            4,
            6,
            10,
        ]  # each window's first forward


def test_lightning_data_records_carry_the_ids_each_step_received(lightning_id_runs):
    """Lightning's DistributedSampler, 3 steps over two epochs: the first epoch's iterator (made before
    on_train_start) and the second's (made through the watched loader) both carry the ids."""
    run, logged = lightning_id_runs[""]
    for rank in (0, 1):
        assert [s for s, _ in logged[rank]] == [1, 1, 2, 3, 3]
        assert data_ids(run, rank) == logged[rank]
    assert {i for _, ids in logged[0][:3] for i in ids}.isdisjoint(
        i for _, ids in logged[1][:3] for i in ids
    )


def test_lightning_training_step_calling_forward_keeps_the_ids_on_their_batch(lightning_id_runs):
    """training_step calls self(x) inside DDP's forward: that second forward is a micro-batch of its own to
    attach, with no ids; the ids stay with the forward that took the batch, none lands on another."""
    run, logged = lightning_id_runs["self-call"]
    for rank in (0, 1):
        records = data_ids(run, rank)
        assert [r for r in records if r[1]] == logged[rank]
        assert len(records) == 2 * len(logged[rank])


def test_lightning_random_sampler_records_no_ids(lightning_id_runs):
    run, logged = lightning_id_runs["random"]
    for rank in (0, 1):
        assert [(s, []) for s, _ in logged[rank]] == data_ids(run, rank)


def test_accelerate_shard_ids_are_read_ahead_without_changing_the_batches():
    """In process, two ranks' DataLoaderShards as accelerate prepares them (no drop_last: the last batch wraps
    around): the ids read ahead are each epoch's batches, and reading leaves the batches as they were."""
    pytest.importorskip("accelerate", reason="accelerate could not be installed here")
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader, RandomSampler

    from disttrace.run.attach import _planned_sample_ids

    items = [{"idx": i} for i in range(20)]

    def shard(rank, seedable=True):
        return prepare_data_loader(
            DataLoader(items, batch_size=3, sampler=RandomSampler(items)),
            num_processes=2,
            process_index=rank,
            use_seedable_sampler=seedable,
            data_seed=0,
        )

    for rank in (0, 1):
        read, untouched = shard(rank), shard(rank)
        for epoch in range(2):
            read.set_epoch(epoch)
            untouched.set_epoch(epoch)
            planned = _planned_sample_ids(read)
            batches = [b["idx"].tolist() for b in read]
            assert planned == batches == [b["idx"].tolist() for b in untouched]
        assert [len(b) for b in batches] == [
            3,
            3,
            3,
            3,
        ]  # 7 batches of 20 items: the last completed from the first
    assert _planned_sample_ids(shard(0, seedable=False)) is None


def test_a_batch_samplers_own_sampler_is_the_one_read():
    """DataLoader(batch_sampler=BatchSampler(RandomSampler)): loader.sampler is a default SequentialSampler
    nobody iterates; reading it, or the RandomSampler, ahead would give wrong ids (and draw from the global
    generator). No ids; a batch sampler over a DistributedSampler gives that sampler's."""
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

    from disttrace.run.attach import _planned_sample_ids

    items = list(range(8))
    state = torch.get_rng_state()
    assert (
        _planned_sample_ids(
            DataLoader(items, batch_sampler=BatchSampler(RandomSampler(items), 4, False))
        )
        is None
    )
    assert torch.equal(state, torch.get_rng_state())
    sampler = DistributedSampler(items, num_replicas=2, rank=1, seed=3)
    loader = DataLoader(items, batch_sampler=BatchSampler(sampler, 2, False))
    ids = list(sampler)
    assert _planned_sample_ids(loader) == [b.tolist() for b in loader] == [ids[:2], ids[2:]]
    assert (
        _planned_sample_ids(DataLoader(items, batch_size=2, num_workers=2, in_order=False)) is None
    )


def test_a_watched_dataloadershard_reports_its_class_and_gets_it_back(tmp_path):
    """accelerate's DataLoaderShard answers `__class__` with its inner DataLoader's class (a read-only
    property): attach swaps its real class to watch it, and close swaps it back; every batch's ids recorded."""
    pytest.importorskip("accelerate", reason="accelerate could not be installed here")
    from accelerate.data_loader import DataLoaderShard, prepare_data_loader
    from torch.utils.data import DataLoader, RandomSampler

    import disttrace.api

    items = [{"x": torch.full((2,), float(i)), "idx": i} for i in range(16)]
    loader = prepare_data_loader(
        DataLoader(items, batch_size=2, sampler=RandomSampler(items)),
        num_processes=2,
        process_index=1,
        use_seedable_sampler=True,
        data_seed=0,
    )
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = disttrace.api.attach(model, opt, out=tmp_path, loader=loader)
    assert type(loader) is not DataLoaderShard and isinstance(loader, DataLoaderShard)
    assert loader.__class__ is DataLoader
    seen = []
    for batch in loader:
        seen.append(batch["idx"].tolist())
        model(batch["x"]).sum().backward()
        opt.step()
        opt.zero_grad()
    run.close()
    assert type(loader) is DataLoaderShard and loader.__class__ is DataLoader
    assert (
        len(seen) == 4
        and [r["samples"] for r in Run(run.run_dir).records(0) if r["phase"] == "data"] == seen
    )
