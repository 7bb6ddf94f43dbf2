"""diff: compare the trajectories of two runs and find the first divergence (docs/design.md, "Order", "Equality").

    result = diff_runs("runs/ab12/reference", "runs/ab12/fault")

* Compatibility first: runs of different editions are refused (unless allowed), and so are runs of
  different experiments (data, tokenizer, seed, model, optimisation, global batch), naming every field.
* Mode: ``bitwise`` (digests must match; the default when both runs have the same topology) or
  ``numeric`` (float statistics within a derived tolerance, see tolerance.py; the default across
  topologies, and when the caller gives rtol/atol).
* Order: records are ordered by (step, micro_batch, phase, rank, index); the first divergence is the
  smallest key whose records differ or that exists on one side only.
* Work: the per-rank step index holds a digest of each step's record digests; a step whose digests agree
  and whose raw bytes are the same on both sides is skipped without decoding a record (the index's digest
  alone never skips a step: its writer may have forged it). Every other step is read, by seeking to its
  byte range.
* Propagation: from the first divergent step on, per step and rank, how many tensors differ out of how
  many, the largest relative error per phase, and the steps where everything is equal again.

Everything here reads the run store only and imports no torch: a run written on a cluster is diffed on a
laptop.
"""

from __future__ import annotations

from pathlib import Path

from disttrace.analysis.diff.serial import diff_serial
from disttrace.analysis.result import DiffResult
from disttrace.errors import BadInput


def diff_runs(
    a: str | Path,
    b: str | Path,
    mode: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    allow_edition_mismatch: bool = False,
    *,
    use_index: bool = True,
    propagate: bool = True,
    on_step=None,
    calibration: str | Path | None = None,
    find_calibration: bool = True,
    jobs: int = 1,
) -> DiffResult:
    """Compare run `b` against run `a`; `.to_json()` of the result is the `diff --json` document.

    mode: None (bitwise when the topologies are equal and no rtol/atol is given, else numeric), "bitwise"
    or "numeric". rtol/atol replace the derived tolerance (a missing one counts as 0).
    use_index=False ignores the step digests and reads every record (the bench's baseline).
    propagate=False stops at the first divergent step (propagation then holds that step only).
    on_step(done, total), if given, is called before each compared step (a progress display).
    calibration: a `disttrace calibrate` file of A's or B's manifest; its measured bounds replace the derived
    ones where it has them (each bound in the result says `bound_kind`: derived, calibrated or none). Without
    it, a calibration of A's (else B's) manifest beside the run (`calibrate` writes runs/<id12>/
    calibration.json) is used, unless find_calibration=False.
    jobs > 1 compares in that many processes (analysis/diff/parallel/: ranks split between them where the
    topologies are the same, steps across topologies); the result is the one this process would return.
    Raises BadInput (exit 2) for unreadable or incompatible runs.
    """
    if jobs != 1:
        from disttrace.analysis.diff import parallel

        if not propagate:
            raise BadInput("--jobs", "needs the whole propagation (propagate=True)", field="jobs")
        return parallel.diff_jobs(
            a,
            b,
            jobs,
            mode=mode,
            rtol=rtol,
            atol=atol,
            allow_edition_mismatch=allow_edition_mismatch,
            use_index=use_index,
            calibration=calibration,
            find_calibration=find_calibration,
        )
    return diff_serial(
        a,
        b,
        mode,
        rtol,
        atol,
        allow_edition_mismatch,
        use_index=use_index,
        propagate=propagate,
        on_step=on_step,
        calibration=calibration,
        find_calibration=find_calibration,
    )
