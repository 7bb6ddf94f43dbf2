"""The layout an attached job's evidence states (topology.json's dp and tp groups, the manifest's
parallelism), from what each rank reported at attach: its engine's groups and its DTensor parameters'
shard groups. Plain functions of the ranks' views: no processes needed (the jobs themselves are in
test_attach_loader.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from disttrace.run.attach import attached_layout, topology_doc


def view(rank, ddp_group=None, fsdp=(), shard=None):
    params = {"w": {"digest": "x", "constant": False, **({"shard": shard} if shard else {})}}
    return {
        "rank": rank,
        "host": "h",
        "node_rank": 0,
        "local_rank": rank,
        "pid": 1,
        "params": params,
        "ddp_group": ddp_group,
        "process_groups": [],
        "fsdp_groups": [list(g) for g in fsdp],
        "seed": 0,
    }


@pytest.mark.parametrize(
    "kind,views,dp,tp",
    [
        ("DDP", [view(r, ddp_group=[0, 1]) for r in range(2)], [[0, 1]], [[0], [1]]),
        (
            "DDP",
            [view(r, ddp_group=[r % 2, r % 2 + 2]) for r in range(4)],
            [[0, 2], [1, 3]],
            [[0], [1], [2], [3]],
        ),
        # tensor parallelism over the whole world: one batch, dp = 1
        ("DTensor", [view(r, shard={"tp": [[0, 1]]}) for r in range(2)], [[0], [1]], [[0, 1]]),
        # a (dp, tp) mesh of DTensors without an engine: tp rows, dp the ranks at one tp position
        (
            "DTensor",
            [view(r, shard={"tp": [[0, 1], [2, 3]]}) for r in range(4)],
            [[0, 2], [1, 3]],
            [[0, 1], [2, 3]],
        ),
        # FSDP2 alone: its shard groups are dp, its own shard dimension is not tp
        (
            "FSDP2",
            [view(r, fsdp=[[0, 1]], shard={"dp": [[0, 1]]}) for r in range(2)],
            [[0, 1]],
            [[0], [1]],
        ),
        # FSDP2 over dp x TP: parameters sharded over both mesh dimensions
        (
            "FSDP2",
            [
                view(
                    r, fsdp=[[0, 2], [1, 3]], shard={"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}
                )
                for r in range(4)
            ],
            [[0, 2], [1, 3]],
            [[0, 1], [2, 3]],
        ),
        # no engine, nothing sharded: one data-parallel world, as before
        ("none", [view(r) for r in range(3)], [[0, 1, 2]], [[0], [1], [2]]),
        # not a grid (groups of two sizes): tp is not claimed
        (
            "DTensor",
            [view(r, shard={"a": [[0, 1], [2]]}) for r in range(3)],
            [[0, 1, 2]],
            [[0], [1], [2]],
        ),
    ],
)
def test_attached_layout(kind, views, dp, tp):
    assert attached_layout(kind, views) == (dp, tp)


def test_topology_places_each_rank_in_its_dp_and_tp_groups():
    views = [view(r, shard={"tp": [[0, 1], [2, 3]]}) for r in range(4)]
    topo = topology_doc(SimpleNamespace(kind="DTensor"), views)
    assert topo.mesh_shape == {"pp": 1, "dp": 2, "tp": 2}
    assert [r.coords for r in topo.ranks] == [
        {"pp": 0, "dp": d, "tp": t} for d, t in ((0, 0), (0, 1), (1, 0), (1, 1))
    ]
