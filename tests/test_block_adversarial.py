"""The compiled block decoder (store/blockdecode.py) on blocks crafted against each length, size and offset it
reads from a step (tests/adversarial_block.py): it declines, or decodes as the pyarrow path (the oracle) does.

A length of 2^61 or 2^62 in a field node is the kind unchecked indexing makes dangerous: size checks that
multiply lengths by widths see 8 * 2^61 wrap int64 to 0, which every buffer passes; a kernel would then read
a list's values, a dictionary's offsets or a view's bytes past their buffers, and for samples and shard give a
batch of bytes read out of bounds where pyarrow refuses the step.

Each case runs with the C kernels (skipped where they are not built), and under AddressSanitizer where they
are built with it (docs/benchmarks.md says how).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("disttrace.store.blockdecode", exc_type=ImportError)
import adversarial_block as adv  # noqa: E402
from test_block_compiled import kernels  # noqa: E402, F401 (the fixture)
from test_block_decode import block_kernels  # noqa: E402

from disttrace.store import blockdecode, trajectory_decode  # noqa: E402


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    return dict(adv.cases(adv.good_block(tmp_path_factory.mktemp("adv"))))


# each a length whose product with a width wraps int64 (to 0 or a negative size)
_WRAPPING = [
    f"list node 17 child count {1 << 61}, offsets past its values",  # samples: 8 cl = 2^64
    f"list node 20 child count {1 << 61}, offsets past its values",  # shard
    f"dictionary values {1 << 61}, an entry past them",  # 8 dv
    f"dictionary length {(1 << 62) - 1}",  # 4 (dn + 1)
    f"batch length {1 << 62}",  # 4 length, 8 length, 16 length
]


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("name", _WRAPPING)
def test_a_length_whose_sizes_wrap_declines_at_the_header(crafted, name):
    block = crafted[name]
    assert (
        blockdecode.kernel_status(block) == 5
    )  # field nodes out of bounds, before any buffer is read
    assert blockdecode.decode(block) is None
    with pytest.raises(trajectory_decode._DECODE_ERRORS):  # the oracle: pyarrow refuses the step
        trajectory_decode._decode_block(block)


@pytest.mark.usefixtures("kernels")
def test_the_reemitted_block_still_decodes(crafted):
    """The control: the same step with every buffer stored as it is, its sizes the real ones, decodes."""
    block = crafted["reemitted, every buffer stored"]
    assert blockdecode.kernel_status(block) == 0
    got, starts = blockdecode.decode(block)
    want, want_starts = trajectory_decode._decode_block(block)
    assert got.equals(want) and starts.tolist() == want_starts.tolist()


def _run_all(tmp_path: Path) -> str:
    """Every crafted case in a fresh interpreter with the C kernels, resumed at the next case after a crash."""
    env = {
        **os.environ,
        "DISTTRACE_NATIVE": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    out, first = [], 0
    script = str(Path(__file__).parent / "adversarial_block.py")
    while True:
        proc = subprocess.run(
            [sys.executable, script, str(tmp_path), str(first)],
            env=env,
            capture_output=True,
            text=True,
        )
        out.append(proc.stdout + proc.stderr)
        if proc.returncode in (0, 1):
            return "\n".join(out)
        started = [line for line in proc.stdout.splitlines() if line.startswith("START")]
        assert started, proc.stderr[-3000:]
        out.append(f"CRASH rc={proc.returncode} in {started[-1]}")
        first = int(started[-1].split()[1]) + 1


@pytest.mark.slow  # a fresh interpreter
def test_every_crafted_block_declines_or_decodes_as_pyarrow(tmp_path):
    block_kernels()  # skipped where the C kernels are not built
    log = _run_all(tmp_path)
    assert "CRASH" not in log and "BUG" not in log, log[-6000:]
    assert log.count("DONE") == len(list(adv.cases(adv.good_block(tmp_path)))), log[-3000:]
    # the controls (the same bytes stored, in a stored LZ4 block, as literals only): not everything declines
    assert log.count("decoded as the pyarrow path") >= 3, log[-3000:]
