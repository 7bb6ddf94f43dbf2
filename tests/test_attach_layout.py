"""The layout an attached job's evidence states (topology.json's dp and tp groups, the manifest's
parallelism), from what each rank reported at attach: its engine's groups and its DTensor parameters'
shard groups. Plain functions of the ranks' views: no processes needed (the jobs themselves are in
test_attach_loader.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from disttrace.analysis.replica_rules import rule_applies
from disttrace.errors import BadInput
from disttrace.run.attach import attached_layout, infer_replicas, topology_doc
from disttrace.run.attach.replicas import layout_groups, parse_layout


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


# ------------------------------------------------------------------ expert and context parallelism


def ep_cp_view(rank, ddp_group, params, ignored=(), layout=None, shard=None):
    """A rank's view with its parameters' digests ({name: digest}), DDP's ignored ones, attach(layout=)."""
    v = view(rank, ddp_group=ddp_group)
    v["params"] = {
        n: {"digest": d, "constant": False, **({"shard": shard} if shard else {})}
        for n, d in params.items()
    }
    if ignored:
        v["ddp_ignored"] = list(ignored)
    if layout:
        v["layout"] = layout
    return v


def _applies(replicas, phase, tensor):
    """The dims of the rules that hold `tensor` at `phase`."""
    return sorted(
        r.dim for r in replicas.rules if rule_applies(r, {"phase": phase, "tensor": tensor})
    )


def test_ddp_ignored_parameters_are_each_ranks_own_and_the_rest_still_agree():
    # expert parallelism by hand: each rank's experts differ and DDP ignores them; dp = 4, ep = 2, so
    # the slice [0, 2] hold is one (as is [1, 3]'s): copies identical at attach must stay identical
    views = [
        ep_cp_view(
            r,
            [0, 1, 2, 3],
            {"router.weight": "R", "experts[0]": f"E{r % 2}"},
            ignored=["experts[0]"],
        )
        for r in range(4)
    ]
    rep = infer_replicas("DDP", views)
    assert _applies(rep, "reduce", "router.weight") == ["dp"]
    assert _applies(rep, "optimizer", "router.weight:momentum_buffer") == ["dp"]
    assert _applies(rep, "optimizer", "param_groups.0.lr") == ["dp"]
    assert _applies(rep, "clip", "grad_norm") == ["dp"]
    assert _applies(rep, "data", "inputs") == ["dp"]
    # the expert slice: not DDP's rule, but its own replicas' (the name's brackets taken literally)
    assert _applies(rep, "reduce", "experts[0]") == ["replicas"]
    assert _applies(rep, "optimizer", "experts[0]:momentum_buffer") == ["replicas"]
    assert _applies(rep, "reduce", "experts0") == []
    assert rep.groups["replicas"] == [[0, 2], [1, 3]]


def test_without_ignored_parameters_ddps_rules_are_unchanged():
    views = [ep_cp_view(r, [0, 1], {"w": "W"}) for r in range(2)]
    rules = [r.doc() for r in infer_replicas("DDP", views).rules]
    assert rules == [
        {"phase": p, "dim": "dp", "relation": "differ" if p == "data" else "agree"}
        for p in ("data", "reduce", "clip", "optimizer")
    ]


def test_a_context_parallel_group_reads_one_batch_and_dp_shards_still_differ():
    views = [
        ep_cp_view(r, [0, 1, 2, 3], {"w": "W"}, layout={"cp": [r // 2 * 2, r // 2 * 2 + 1]})
        for r in range(4)
    ]
    rep = infer_replicas("DDP", views)
    assert rep.groups["cp"] == [[0, 1], [2, 3]]
    assert rep.groups["dp-shards"] == [[0, 2], [1, 3]]
    assert _applies(rep, "data", "inputs") == ["dp-shards"]
    assert _applies(rep, "loss", "loss") == []  # a cp rank's loss may be its slice's
    assert _applies(rep, "reduce", "w") == ["dp"]


def test_an_expert_parallel_mesh_dimension_is_not_tensor_parallelism():
    for dim, layout in (("ep", None), ("experts", {"ep": [0, 1]})):
        views = [
            ep_cp_view(r, None, {"w": f"W{r}"}, layout=layout, shard={dim: [[0, 1]]})
            for r in range(2)
        ]
        rep = infer_replicas("DTensor", views)
        assert _applies(rep, "data", "inputs") == [] and _applies(rep, "loss", "loss") == [], dim
        assert attached_layout("DTensor", views)[1] == [[0], [1]], dim
    # a dimension not named, nor said, for experts stays tensor parallelism
    views = [ep_cp_view(r, None, {"w": f"W{r}"}, shard={"experts": [[0, 1]]}) for r in range(2)]
    assert _applies(infer_replicas("DTensor", views), "data", "inputs") == ["mesh:experts"]


@pytest.mark.parametrize(
    "layout,field",
    [
        ({"tp": [0, 1]}, "'tp'"),
        ({"cp": "0,1"}, "'cp'"),
        ({"cp": [1, 2]}, "'cp'"),  # rank 0 passed a group without itself
        ({"ep": [0, 0]}, "'ep'"),
        ([0, 1], "layout="),
    ],
)
def test_a_bad_layout_is_refused_naming_its_field(layout, field):
    with pytest.raises(BadInput) as e:
        parse_layout(layout, 0)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_layout_groups_that_do_not_split_the_world_are_refused():
    views = [ep_cp_view(r, [0, 1, 2], {"w": "W"}, layout={"cp": [0, 1]}) for r in range(2)]
    views.append(ep_cp_view(2, [0, 1, 2], {"w": "W"}, layout={"cp": [2]}))
    with pytest.raises(BadInput, match="'cp'"):
        layout_groups(views)
