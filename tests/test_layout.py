"""DDP bucket layouts: the facts of docs/ddp-facts.md §3 one by one, properties of the cap
rule, and a differential test against real DDP on gloo (``-m gloo``)."""

from __future__ import annotations

import doctest
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from simcluster.errors import UsageError
from simcluster.real.gloo_runner import GlooCluster
from simcluster.ddp.layout import bucket_assignment, bucket_calls, cap_bytes, rebuild_iteration

MiB = 2**20


def f32(*numels: int) -> list[torch.Tensor]:
    """Meta tensors: the layout needs only numel, dtype and device."""
    return [torch.empty(n, device="meta") for n in numels]



def test_module_examples_run() -> None:
    import simcluster.ddp.layout as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0

# ---------------------------------------------------------------- the facts
def test_iteration0_is_one_bucket_in_parameter_order_whatever_the_cap() -> None:
    params = f32(100, 200, 300, 400)
    for cap in (None, 0, 1e-6, 0.001, 25):
        assert bucket_assignment(params, iteration=0, bucket_cap_mb=cap) == [[0, 1, 2, 3]]


def test_rebuild_follows_ready_order_and_closes_at_the_cap() -> None:
    params = f32(64, 64, 64, 64, 64)  # 256 bytes each
    cap = 512 / MiB  # two tensors reach it exactly
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=cap) == [[4, 3], [2, 1], [0]]
    order = [2, 0, 4, 1, 3]
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=cap, ready_order=order) == [[2, 0], [4, 1], [3]]
    # the rebuilt layout stays for every later iteration
    assert bucket_assignment(params, iteration=7, bucket_cap_mb=cap, ready_order=order) == [[2, 0], [4, 1], [3]]


def test_a_bucket_overshoots_by_one_tensor_and_never_splits_one() -> None:
    params = f32(10, 1000, 10)  # 40 B, 4000 B, 40 B
    # ready order 2, 1, 0: 40 B < 100 B, then + 4000 B closes the bucket far past the cap
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=100 / MiB) == [[2, 1], [0]]
    # a tensor larger than the cap is a bucket of its own, whole
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=100 / MiB, ready_order=[1, 0, 2]) == [[1], [0, 2]]


def test_default_cap_uses_a_one_mib_first_bucket_but_an_explicit_cap_does_not() -> None:
    assert int(torch.distributed._DEFAULT_FIRST_BUCKET_BYTES) == MiB
    assert cap_bytes(None) == (MiB, 25 * MiB)
    assert cap_bytes(25) == (25 * MiB, 25 * MiB)
    params = f32(2**18, 2**18, 2**18, 10)  # three 1 MiB tensors and a small one
    assert bucket_assignment(params, iteration=1) == [[3, 2], [1, 0]]
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=25) == [[3, 2, 1, 0]]
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=1) == [[3, 2], [1], [0]]
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=0.5) == [[3, 2], [1], [0]]


def test_static_graph_rebuilds_from_iteration_2() -> None:
    params = f32(64, 64, 64)
    cap = 256 / MiB
    assert rebuild_iteration(static_graph=True) == 2
    for it in (0, 1):
        assert bucket_assignment(params, iteration=it, bucket_cap_mb=cap, static_graph=True) == [[0, 1, 2]]
    assert bucket_assignment(params, iteration=2, bucket_cap_mb=cap, static_graph=True) == [[2], [1], [0]]
    # static_graph wins over find_unused_parameters (measured)
    both = dict(bucket_cap_mb=cap, static_graph=True, find_unused_parameters=True)
    assert bucket_assignment(params, iteration=1, **both) == [[0, 1, 2]]
    assert bucket_assignment(params, iteration=2, **both) == [[2], [1], [0]]


def test_find_unused_parameters_caps_from_iteration0_reversed_and_never_rebuilt() -> None:
    params = f32(64, 16, 64, 64)  # 256, 64, 256, 256 bytes
    cap = 300 / MiB
    # walked in parameter order: [0, 1] reaches 320 B, [2, 3] reaches 512 B; list reversed
    expected = [[2, 3], [0, 1]]
    assert rebuild_iteration(find_unused_parameters=True) is None
    for it in (0, 1, 5):
        got = bucket_assignment(params, iteration=it, bucket_cap_mb=cap, find_unused_parameters=True, ready_order=[0, 1, 2, 3])
        assert got == expected


def test_find_unused_parameters_with_default_cap_closes_the_first_bucket_at_one_mib() -> None:
    params = f32(2**18, 10, 2**18)
    assert bucket_assignment(params, iteration=0, find_unused_parameters=True) == [[1, 2], [0]]


def test_each_dtype_gets_its_own_buckets() -> None:
    d = torch.float64
    params = [torch.empty(8, device="meta"), torch.empty(8, device="meta", dtype=d), torch.empty(8, device="meta")]
    for kw in (dict(iteration=0), dict(iteration=1), dict(iteration=1, bucket_cap_mb=0)):
        layout = bucket_assignment(params, **kw)
        for bucket in layout:
            assert len({params[i].dtype for i in bucket}) == 1
        assert sorted(i for b in layout for i in b) == [0, 1, 2]
    assert len(bucket_assignment(params, iteration=0)) == 2


def test_hook_calls_report_index_and_is_last() -> None:
    params = f32(64, 64, 64)
    calls = bucket_calls(params, iteration=1, bucket_cap_mb=0)
    assert [(c.index, c.is_last) for c in calls] == [(0, False), (1, False), (2, True)]
    assert [c.params for c in calls] == [(2,), (1,), (0,)]


def test_first_static_graph_iteration_reports_index_0_for_every_bucket() -> None:
    d = torch.float64
    params = [torch.empty(8, device="meta"), torch.empty(8, device="meta", dtype=d)]
    calls = bucket_calls(params, iteration=0, static_graph=True)
    assert [(c.index, c.is_last) for c in calls] == [(0, False), (0, False)]
    assert [(c.index, c.is_last) for c in bucket_calls(params, iteration=1, static_graph=True)] == [(0, False), (1, True)]
    one = bucket_calls(f32(4, 4), iteration=0, static_graph=True)
    assert [(c.index, c.is_last) for c in one] == [(0, True)]


def test_bucket_cap_mb_list_applies_before_and_after_the_rebuild() -> None:
    params = f32(64, 64, 64, 64, 64)
    caps = [256 / MiB, 512 / MiB]  # the last cap repeats
    assert bucket_assignment(params, iteration=0, bucket_cap_mb_list=caps) == [[3, 4], [1, 2], [0]]
    assert bucket_assignment(params, iteration=1, bucket_cap_mb_list=caps) == [[4], [3, 2], [1, 0]]
    assert bucket_assignment(params, iteration=1, bucket_cap_mb_list=[]) == [[4, 3, 2, 1, 0]]  # ignored


def test_last_bucket_small_walks_the_ready_order_backwards() -> None:
    # measured with DDP_SET_LAST_BUCKET_CAP=1: buckets keep the reversed walk's inner order
    params = f32(64, 64, 64)
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=512 / MiB, last_bucket_small=True) == [[2], [0, 1]]


def test_zero_and_negative_caps() -> None:
    params = f32(8, 8, 8)
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=0) == [[2], [1], [0]]
    assert bucket_assignment(params, iteration=1, bucket_cap_mb=-1) == [[2, 1, 0]]
    with pytest.raises(UsageError, match="TypeError"):
        bucket_assignment(params, iteration=0, bucket_cap_mb=-1, find_unused_parameters=True)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(ready_order=[0, 1]), r"missing \[2\]"),
        (dict(ready_order=[0, 1, 1]), r"repeated \[1\]"),
        (dict(ready_order=[0, 1, 3]), r"ready_order\[2\]=3"),
        (dict(ready_order=[0, True, 2]), r"ready_order\[1\]=True"),
        (dict(ready_order="012"), "ready_order='012'"),
        (dict(iteration=-1), "iteration=-1"),
        (dict(iteration=1.0), "iteration=1.0"),
        (dict(bucket_cap_mb=float("inf")), "bucket_cap_mb=inf"),
        (dict(bucket_cap_mb="25"), "bucket_cap_mb='25'"),
        (dict(bucket_cap_mb_list=[1, float("nan")]), r"bucket_cap_mb_list\[1\]=nan"),
        (dict(static_graph=1), "static_graph=1"),
    ],
)
def test_bad_arguments_are_usage_errors_naming_the_value(kwargs: dict[str, Any], needle: str) -> None:
    call: dict[str, Any] = dict(iteration=1)
    call.update(kwargs)
    with pytest.raises(UsageError, match=needle):
        bucket_assignment(f32(4, 4, 4), **call)


def test_bad_params_are_usage_errors() -> None:
    t = torch.empty(4)
    with pytest.raises(UsageError, match=r"params\[1\] is the same tensor as params\[0\]"):
        bucket_assignment([t, t], iteration=0)
    with pytest.raises(UsageError, match="params=\\[\\]"):
        bucket_assignment([], iteration=0)
    with pytest.raises(UsageError, match=r"params\[0\]=3"):
        bucket_assignment([3], iteration=0)


# ------------------------------------------------------------ the cap rule
@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    cap=st.integers(0, 2000),
    data=st.data(),
)
def test_rebuilt_buckets_close_as_soon_as_they_reach_the_cap(numels: list[int], cap: int, data: st.DataObject) -> None:
    params = f32(*numels)
    order = data.draw(st.permutations(range(len(numels))))
    layout = bucket_assignment(params, iteration=1, bucket_cap_mb=cap / MiB, ready_order=order)
    assert [i for b in layout for i in b] == list(order)
    for k, bucket in enumerate(layout):
        sizes = [4 * numels[i] for i in bucket]
        assert all(sum(sizes[:j]) < cap for j in range(1, len(sizes)))  # no earlier close
        if k < len(layout) - 1:
            assert sum(sizes) >= cap  # closed buckets reached the cap


@settings(max_examples=40, deadline=None)
@given(dtypes=st.lists(st.sampled_from([torch.float32, torch.float64, torch.float16]), min_size=1, max_size=10), data=st.data())
def test_mixed_dtypes_keep_ready_order_within_each_dtype(dtypes: list[torch.dtype], data: st.DataObject) -> None:
    params = [torch.empty(16, device="meta", dtype=d) for d in dtypes]
    order = data.draw(st.permutations(range(len(dtypes))))
    layout = bucket_assignment(params, iteration=1, bucket_cap_mb=100 / MiB, ready_order=order)
    for d in set(dtypes):
        in_buckets = [i for b in layout for i in b if params[i].dtype == d]
        assert in_buckets == [i for i in order if params[i].dtype == d]
    assert all(len({params[i].dtype for i in b}) == 1 for b in layout)


# ------------------------------------------------- against real DDP on gloo
class LayerStack(torch.nn.Module):
    """``layers[k] = (in, out, dtype name)`` applied in the order ``use`` (inputs cast to
    each layer's dtype)."""

    def __init__(self, layers: list[list[Any]], use: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o).to(getattr(torch, dt)) for i, o, dt in layers)
        self.use = use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k in self.use:
            x = self.layers[k](x.to(self.layers[k].weight.dtype))
        return x.float()


def _record_real_ddp(spec: dict[str, Any]) -> dict[str, Any]:
    """One case in a gloo rank: the ready order and every hook call of real DDP."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = LayerStack(spec["layers"], spec["use"])
    params = list(model.parameters())
    ddp = DistributedDataParallel(model, **spec["ddp"])
    where = {"it": 0}
    ready: list[tuple[int, int]] = []
    calls: list[tuple[int, int, bool, tuple[int, ...]]] = []
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: ready.append((where["it"], i)))

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotations that are strings
        ids = [next(i for i, q in enumerate(params) if q is p) for p in bucket.parameters()]
        calls.append((where["it"], bucket.index(), bucket.is_last(), tuple(ids)))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    x = torch.randn(3, spec["layers"][spec["use"][0]][0])
    for it in range(spec["iterations"]):
        where["it"] = it
        ddp(x).sum().backward()
    meta = [(tuple(p.shape), str(p.dtype)) for p in params]
    del ddp  # docs/gloo-facts.md §10: no DDP object outlives the job (the runner then collects)
    return {"meta": meta, "ready": ready, "calls": calls}


def real_layout_job(rank: int, world_size: int, payload: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """In each gloo rank: every case of ``payload``, with DDP_SET_LAST_BUCKET_CAP unset
    (it changes the rebuilt layout; see docs/ddp-facts.md) and restored afterwards."""
    saved = os.environ.pop("DDP_SET_LAST_BUCKET_CAP", None)
    try:
        return [_record_real_ddp(spec) for spec in payload]
    finally:
        if saved is not None:
            os.environ["DDP_SET_LAST_BUCKET_CAP"] = saved


STACK = [[8, 16, "float32"], [16, 32, "float32"], [32, 4, "float32"]]
BIG = [[512, 512, "float32"], [512, 256, "float32"], [256, 700, "float32"], [700, 10, "float32"]]
MIXED = [[8, 8, "float32"], [8, 8, "float64"], [8, 8, "float32"], [8, 4, "float64"]]
SWAPPED = [[6, 3, "float32"], [4, 6, "float32"]]  # defined second-layer first

CASES: list[tuple[str, list[list[Any]], list[int], dict[str, Any], int]] = [
    ("stack default cap", STACK, [0, 1, 2], {}, 3),
    ("stack cap splits", STACK, [0, 1, 2], dict(bucket_cap_mb=0.0005), 3),
    ("stack cap 0", STACK, [0, 1, 2], dict(bucket_cap_mb=0), 3),
    ("stack static_graph", STACK, [0, 1, 2], dict(bucket_cap_mb=0.0005, static_graph=True), 4),
    ("stack find_unused", STACK, [0, 1, 2], dict(bucket_cap_mb=0.0005, find_unused_parameters=True), 3),
    ("stack cap list", STACK, [0, 1, 2], dict(bucket_cap_mb_list=[0.0005, 0.002]), 3),
    ("big default cap (1 MiB first bucket)", BIG, [0, 1, 2, 3], {}, 3),
    ("big explicit 25 MB", BIG, [0, 1, 2, 3], dict(bucket_cap_mb=25), 3),
    ("big find_unused default cap", BIG, [0, 1, 2, 3], dict(find_unused_parameters=True), 2),
    ("mixed dtypes", MIXED, [0, 1, 2, 3], {}, 3),
    ("mixed dtypes cap splits", MIXED, [0, 1, 2, 3], dict(bucket_cap_mb=0.0003), 3),
    ("mixed dtypes static_graph", MIXED, [0, 1, 2, 3], dict(static_graph=True), 3),
    ("mixed dtypes find_unused", MIXED, [0, 1, 2, 3], dict(bucket_cap_mb=0.0003, find_unused_parameters=True), 2),
    ("use order differs from definition order", SWAPPED, [1, 0], dict(bucket_cap_mb=0.00001), 3),
]


@pytest.mark.gloo
def test_layout_matches_real_ddp_on_gloo(gloo_world: Callable[[int], GlooCluster]) -> None:
    payload = [dict(layers=layers, use=use, ddp=ddp, iterations=n) for _, layers, use, ddp, n in CASES]
    ranks = gloo_world(2).run(real_layout_job, [payload] * 2)
    assert ranks[0] == ranks[1], "both ranks saw the same hook calls"
    mismatches = []
    for (name, _, _, ddp, iterations), real in zip(CASES, ranks[0]):
        params = [torch.empty(shape, dtype=getattr(torch, dt.split(".")[1]), device="meta") for shape, dt in real["meta"]]
        recorded = rebuild_iteration(
            static_graph=ddp.get("static_graph", False), find_unused_parameters=ddp.get("find_unused_parameters", False)
        )
        ready_iteration = 0 if recorded is None else recorded - 1
        ready = [i for it, i in real["ready"] if it == ready_iteration]
        for it in range(iterations):
            sim = [(it, c.index, c.is_last, c.params) for c in bucket_calls(params, iteration=it, ready_order=ready, **ddp)]
            got = [c for c in real["calls"] if c[0] == it]
            if sim != got:
                mismatches.append(f"{name}, iteration {it}:\n  real DDP: {got}\n  simulated: {sim}")
    assert not mismatches, "\n".join(mismatches)
    # a plain stack's gradients become ready in reverse parameter order (the default)
    stack = ranks[0][0]
    assert [i for it, i in stack["ready"] if it == 0] == list(range(len(stack["meta"]) - 1, -1, -1))
    swapped = ranks[0][-1]
    assert [i for it, i in swapped["ready"] if it == 0] == [1, 0, 3, 2]
