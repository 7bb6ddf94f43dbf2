"""The blocks a propagating diff compares (`_Plan`, summed once) against `_block`, which walks the steps and
asks each rank's index for each of them (the oracle): the same steps in every block, for any start and size."""

from __future__ import annotations

import random

from disttrace.analysis.diff.blocks import _block, _Plan


class _Counts:
    """A side's record_count from a table: None for a step the index does not state."""

    def __init__(self, table: dict):
        self.table = table

    def record_count(self, rank, step):
        return self.table.get((rank, step))


def test_the_plan_gives_the_blocks_that_walking_the_steps_gives():
    rng = random.Random(3)
    for trial in range(40):
        steps = sorted(rng.sample(range(200), rng.randint(1, 60)))
        ranks = list(range(rng.randint(1, 3)))
        sides = tuple(
            _Counts(
                {
                    (r, s): rng.choice([None, 0, 0, 1, 5, 40, 150, 1000])
                    for r in ranks
                    for s in steps
                    if rng.random() < 0.9
                }
            )
            for _ in range(2)
        )
        plan = _Plan(steps, ranks, sides)
        for rows in (0, 1, 100, 1000, 1 << 14):
            n = 0
            while n < len(steps):
                want = _block(steps, n, ranks, sides, rows)
                assert plan.block(n, rows) == want, (trial, rows, n)
                n += len(want)
            # from any start, not only where the last block ended
            n = rng.randrange(len(steps))
            assert plan.block(n, rows) == _block(steps, n, ranks, sides, rows)
