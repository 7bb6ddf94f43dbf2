"""`disttrace verify RUN`: is this run store what its job wrote? Reads and hashes; loads nothing (no torch).

Checks, in this order (the first damage found is the one reported on the line):
1. the files COMPLETE seals (lock, run.json, env, topology, replicas; `events.jsonl` as the prefix written by
   the end of the job; every checkpoint's INDEX.json): sha256 and size (`disttrace.store.seal`);
2. per rank, the step chain of `trajectory/rank-N.steps.jsonl`: each step's raw trajectory bytes against its
   `sha256`, each line's `chain` against the previous one, the steps contiguous in the file and nothing after
   the last, the last chain hash against the seal's; then the rank's files against the seal;
3. files in the run's rank directories that the seal does not name, and links out of the run;
4. every checkpoint: its INDEX (sha256 of every file) and every pickle in it, by opcodes only
   (`disttrace.store.pickles`): a global outside the allowlist is damage.

Result: `intact` (exit 0), `damaged` (exit 1, the first damaged file and step named), `unsealed` (exit 1: no
seal in COMPLETE, either an incomplete run or one written before seals existed; whatever can be checked
without the seal was, and found nothing), or bad input (exit 2: not a run directory).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from disttrace.errors import BadInput
from disttrace.jsondoc import JsonDoc
from disttrace.store import safeio, trajectory
from disttrace.store import seal as sealing
from disttrace.store.checkpoints import status as checkpoint_status
from disttrace.store.checkpoints import verify as verify_checkpoint
from disttrace.store.documents import Complete, FileHash, Seal, parse_doc
from disttrace.store.jsonlines import read_json
from disttrace.store.paths import inside
from disttrace.store.pickles import scan_checkpoint
from disttrace.store.rundir import COMPLETE, Run, rank_file

# written after COMPLETE, or not content: never sealed, never damage
UNSEALED_BY_DESIGN = re.compile(
    r"(eval\.json|verdict\.json|\.launcher-node\d+\.lock|\..*\.tmp-\d+)"
)


@dataclass
class Damage(JsonDoc):
    """What is wrong with one file of the run (at one step of it, where the file holds steps)."""

    file: str  # relative to the run directory
    reason: str
    step: int | None = None

    def line(self) -> str:
        return (
            f"{self.file}: "
            + (f"step {self.step}: " if self.step is not None else "")
            + self.reason
        )


@dataclass
class Checked(JsonDoc):
    """What was checked: sealed files, steps of the chains, ranks, checkpoints."""

    files: int = 0
    steps: int = 0
    ranks: int = 0
    checkpoints: int = 0


@dataclass
class Verdict(JsonDoc):
    """The `verify --json` document (with `intact` added: `to_dict`)."""

    run: str
    status: str = "intact"  # intact | damaged | unsealed
    first_damage: Damage | None = None
    damage: list[Damage] = field(default_factory=list)
    checked: Checked = field(default_factory=Checked)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_ok(self) -> bool:
        return self.status == "intact"

    def to_dict(self) -> dict:
        return {**super().to_dict(), "intact": self.exit_ok}


class _Verifier:
    def __init__(self, run: Run):
        self.run = run
        self.path = run.path
        self.v = Verdict(run=str(run.path))
        self.damaged_files: set[str] = set()

    def rel(self, path) -> str:
        """A path as the run names it (lexically: a link is named, not followed)."""
        try:
            return str(Path(path).relative_to(self.path))
        except ValueError:
            return str(path)

    def damage(self, file: str, reason: str, step: int | None = None) -> None:
        self.damaged_files.add(file)
        self.v.damage.append(Damage(file, reason, step))

    # ------------------------------------------------------------ the seal
    def read_seal(self) -> Seal | None:
        if not safeio.present(self.path / COMPLETE):
            why = self.failure()
            self.v.notes.append(
                "no COMPLETE: the run did not finish, so nothing sealed it"
                + (f" (the job failed: {why})" if why else "")
            )
            return None
        try:
            done = read_json(self.path / COMPLETE, self.path)
        except BadInput as e:
            self.damage(COMPLETE, e.reason)
            return None
        try:
            complete = parse_doc(Complete, done, self.path / COMPLETE)
        except BadInput as e:
            self.damage(COMPLETE, f"{e.field}: {e.reason}" if e.field else e.reason)
            return None
        if complete.seal is None:
            self.v.notes.append(
                "COMPLETE holds no seal (a run written before disttrace sealed its runs)"
            )
        return complete.seal

    def failure(self) -> str | None:
        """Why an unfinished run stopped, as its launcher logged it (the last `job_failed` line)."""
        from disttrace.store.events import JobFailed

        try:
            failed = [e for e in self.run.event_lines() if isinstance(e, JobFailed)]
        except BadInput:  # the events are checked as a file of the run, not here
            return None
        return " ".join(str(failed[-1].reason).split()) if failed and failed[-1].reason else None

    def check_file(self, rel: str, want: FileHash, prefix: bool = False) -> None:
        self.v.checked.files += 1
        if not safeio.store_name(
            rel
        ):  # a seal names files inside the store, never a path of the machine
            self.damage(COMPLETE, f"the seal names {rel!r}, which is not a file inside the run")
            return
        p = self.path / rel
        if p.is_symlink() or not safeio.is_regular(p, self.path):
            self.damage(rel, "sealed at COMPLETE, now missing (or not a plain file)")
            return
        try:
            size = safeio.size(p, self.path)
            digest = sealing.file_hash(p, want.bytes if prefix else None, self.path).sha256
        except BadInput as e:
            self.damage(rel, e.reason)
            return
        if size < want.bytes or (size != want.bytes and not prefix):
            self.damage(rel, f"{size} bytes, sealed with {want.bytes} (truncated or altered)")
            return
        if digest != want.sha256:
            self.damage(rel, "sha256 differs from the seal (altered after the run)")
            return
        if prefix and size > want.bytes:
            self.v.notes.append(
                f"{rel}: {size - want.bytes} bytes appended after the seal (not checked)"
            )

    # ------------------------------------------------------------ the step chain of one rank
    def check_rank(self, rank: int, seal: Seal | None) -> None:
        traj = self.run.trajectory_path(rank)
        traj_rel = f"trajectory/{traj.name}"
        idx_rel = rank_file("trajectory", rank, ".steps.jsonl")
        idx = self.path / idx_rel
        self.v.checked.ranks += 1
        if not safeio.present(idx):
            self.damage(idx_rel, "missing: the step index of this rank's trajectory")
            return
        try:  # the trajectory mapped (never read whole), the index streamed line by line
            data = safeio.mapped(traj, self.path)
            lines = (raw for _, raw in safeio.lines(idx, self.path))
        except BadInput as e:
            self.damage(self.rel(e.where), e.reason)
            return
        prev = sealing.genesis(rank)
        expect_offset = 0
        last_step = None
        unsealed_steps = 0
        n = 0
        lineno = 0
        while True:
            try:
                raw = next(lines, None)
            except BadInput as e:  # a line longer than any index line, or the file refused
                self.damage(idx_rel, e.reason, last_step)
                return
            if raw is None:
                break
            lineno += 1
            if not raw.strip():
                continue
            try:
                e = orjson.loads(raw)
            except orjson.JSONDecodeError:
                self.damage(idx_rel, f"line {lineno} is not valid JSON (torn or edited)", last_step)
                return
            step = e.get("step") if isinstance(e, dict) else None
            if not isinstance(e, dict) or not all(
                isinstance(e.get(k), int) and not isinstance(e.get(k), bool)
                for k in ("step", "offset", "length")
            ):
                self.damage(
                    idx_rel,
                    f"line {lineno} lacks an integer step/offset/length",
                    step if isinstance(step, int) else None,
                )
                return
            n += 1
            if "sha256" not in e and "chain" not in e:
                unsealed_steps += 1
                prev = None
                expect_offset = e["offset"] + e["length"]
                last_step = step
                continue
            if e["offset"] != expect_offset:
                self.damage(
                    idx_rel,
                    f"starts at byte {e['offset']}, the previous step ended at {expect_offset} "
                    "(a step removed, reordered or moved)",
                    step,
                )
                return
            if e["length"] > safeio.LIMITS["step"] or e["offset"] + e["length"] > len(data):
                self.damage(traj_rel, "the index points past the end of the file (truncated)", step)
                return
            chunk = data[e["offset"] : e["offset"] + e["length"]]
            if len(chunk) != e["length"]:
                self.damage(traj_rel, "the index points past the end of the file (truncated)", step)
                return
            if sealing.step_hash(chunk) != e.get("sha256"):
                self.damage(
                    traj_rel,
                    "the step's bytes differ from the sha256 its index line holds (edited)",
                    step,
                )
                return
            if prev is None or sealing.chain_next(prev, e) != e.get("chain"):
                self.damage(
                    idx_rel,
                    "the chain is broken here (a step removed, reordered or its index line edited)",
                    step,
                )
                return
            prev = e["chain"]
            expect_offset = e["offset"] + e["length"]
            last_step = step
        self.v.checked.steps += n
        if unsealed_steps:
            self.v.notes.append(
                f"{idx_rel}: {unsealed_steps} steps without hashes (written before step hashes)"
            )
            return
        # an Arrow stream ends with its end-of-stream marker, outside every step (sealed with the file)
        end = expect_offset + (
            len(trajectory.END_OF_STREAM)
            if len(data) - expect_offset == len(trajectory.END_OF_STREAM)
            and data[expect_offset:] == trajectory.END_OF_STREAM
            else 0
        )
        if len(data) != end:
            self.damage(
                traj_rel,
                f"{len(data) - end} bytes after the last indexed step (appended)",
                last_step,
            )
            return
        if seal is not None:
            want = seal.chains.get(f"{rank:05d}")
            if want is None:
                self.damage(idx_rel, "this rank is not in the seal (a rank added after the run)")
                return
            if want.chain != (prev if n else None) or want.steps != n:
                self.damage(
                    idx_rel,
                    f"ends at step {last_step} after {n} steps, the seal says {want.steps} "
                    "steps and another last hash (steps removed at the end?)",
                    last_step,
                )

    # ------------------------------------------------------------ everything
    def verify(self) -> Verdict:
        seal = self.read_seal()
        files = seal.files if seal is not None else {}
        for rel in sealing.SHARED_FILES:
            if rel in files:
                self.check_file(rel, files[rel])
        if seal is not None and seal.events is not None:
            self.check_file(sealing.EVENTS, seal.events, prefix=True)
        try:
            present = set(self.run.ranks())
        except BadInput as e:  # a rank file that links out of the run
            self.damage(self.rel(e.where), e.reason)
            present = set()
        chains = seal.chains if seal is not None else {}
        ranks = sorted(present | {int(k) for k in chains if k.isdigit()})
        for rank in ranks:
            self.check_rank(rank, seal)
        for rel in sorted(
            files
        ):  # each rank's files, and any other the seal names (INDEX files: below)
            if (
                rel not in sealing.SHARED_FILES
                and not rel.startswith("checkpoints/")
                and rel not in self.damaged_files
            ):
                self.check_file(rel, files[rel])
        if seal is not None:
            self.unsealed_files(files)
        self.links_out()
        self.checkpoints(files)
        if self.v.damage:
            self.v.status = "damaged"
            self.v.first_damage = self.v.damage[0]
        elif seal is None:
            self.v.status = "unsealed"
        return self.v

    def unsealed_files(self, files: dict) -> None:
        for p in sorted(self.path.glob("*/rank-*")):  # every per-rank file the job writes is sealed
            rel = f"{p.parent.name}/{p.name}"
            if rel not in files and not UNSEALED_BY_DESIGN.fullmatch(p.name):
                self.damage(rel, "not in the seal (added after the run)")
        for name in sealing.SHARED_FILES:
            if name not in files and (self.path / name).exists():
                self.damage(name, "not in the seal (added after the run)")

    def links_out(self) -> None:
        for p in sorted(self.path.rglob("*")):  # rglob lists a link without following it
            if p.is_symlink() and not inside(p, self.path):
                self.damage(str(p.relative_to(self.path)), "a link out of the run directory")

    def checkpoints(self, files: dict) -> None:
        for ckpt in self.run.checkpoint_dirs():
            if ckpt.is_symlink():
                continue  # reported by links_out (or a link inside the run: its target is checked there)
            rel_index = f"checkpoints/{ckpt.name}/INDEX.json"
            self.v.checked.checkpoints += 1
            step = int(ckpt.name.split("-")[1])
            if files and rel_index in files:
                self.check_file(rel_index, files[rel_index])
            elif files:
                self.damage(rel_index, "checkpoint not in the seal (added after the run)", step)
                continue
            try:
                verify_checkpoint(ckpt, self.run.manifest_id, self.path)
            except BadInput as e:
                self.damage(
                    self.rel(e.where), f"{e.field + ': ' if e.field else ''}{e.reason}", step
                )


def verify_run(run_dir: Path | str) -> Verdict:
    """Raises BadInput (exit 2) when `run_dir` is not a run; else the verdict."""
    return _Verifier(Run(run_dir)).verify()


def summary_line(v: Verdict) -> str:
    c = v.checked
    if v.status == "damaged":
        more = f" (and {len(v.damage) - 1} more)" if len(v.damage) > 1 else ""
        return "damaged: " + v.first_damage.line() + more
    what = (
        f"{c.files} sealed files, {c.steps} steps on {c.ranks} ranks, {c.checkpoints} checkpoints "
        "(every pickle scanned)"
    )
    if v.status == "unsealed":
        why = "; ".join(n for n in v.notes if "COMPLETE" in n) or "no seal"
        return f"unsealed: {why}; checked what could be: {what}"
    return f"intact: {what}"


def find_reference(out: Path, manifest_id: str) -> Path | None:
    """A reference run of `manifest_id` in the runs root `out` (out/<id12>/reference*, newest first) that can
    be reused: complete, with checkpoints that all verify, and its store verifying; None when there is none.
    A checkpoint whose pickle would run code is bad input, not a reference to pass over quietly."""
    base = out / manifest_id[:12]
    for d in sorted(base.glob("reference*"), reverse=True) if base.is_dir() else []:
        try:
            run = Run(d)
        except BadInput:
            continue
        if not (run.complete and run.manifest_id == manifest_id and run.checkpoint_dirs()):
            continue
        for c in run.checkpoint_dirs():
            finding = scan_checkpoint(c)
            if finding is not None and "global" in finding.reason:
                raise BadInput(
                    finding.file,
                    f"{finding.reason}; this reference in the runs root is not safe to "
                    "reuse: remove it or use another --out",
                )
        if (
            all(checkpoint_status(c, manifest_id)[0] for c in run.checkpoint_dirs())
            and verify_run(d).exit_ok
        ):
            return d
    return None
