"""SimGradBucket: DDP's GradBucket semantics, the legacy API, loud misuse errors,
and a comparison with real GradBuckets recorded inside real DDP (``-m gloo``)."""

from __future__ import annotations

import copy
import doctest
import os
import pickle
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

from simcluster.fake.bucket import SimGradBucket, make_bucket, packing
from simcluster.errors import (
    GradBucketAttributeError, GradBucketRuntimeError, GradBucketTypeError, HookFailure, UsageError,
)
from simcluster.real.gloo_runner import GlooCluster


def two_params() -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(2))]
    grads = [torch.arange(6.0).view(2, 3), torch.tensor([6.0, 7.0])]
    return params, grads


def bucket(index: int = 1, *, is_last: bool = False, **kw: Any) -> SimGradBucket:
    params, grads = two_params()
    return make_bucket(index, params, grads, is_last=is_last, **kw)



def test_module_examples_run() -> None:
    import simcluster.fake.bucket as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0

# ----------------------------------------------------------- current API
def test_buffer_is_flat_contiguous_and_packs_gradients_in_parameter_order() -> None:
    params, grads = two_params()
    b = make_bucket(3, params, grads, is_last=True)
    buf = b.buffer()
    assert buf.dim() == 1 and buf.is_contiguous() and buf.dtype == torch.float32
    assert buf.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert b.buffer() is buf
    assert b.index() == 3 and b.is_last() is True
    buf.zero_()
    assert grads[0].sum() == 15, "the buffer is a copy: the caller's grads are untouched"


def test_gradients_are_fresh_views_into_the_buffer_shaped_like_the_parameters() -> None:
    b = bucket()
    g = b.gradients()
    assert [tuple(t.shape) for t in g] == [(2, 3), (2,)]
    assert [t.storage_offset() for t in g] == [0, 6]
    g[1].fill_(-1.0)
    assert b.buffer()[6:].tolist() == [-1.0, -1.0]
    assert b.gradients()[0] is not g[0] and b.gradients() is not g


def test_parameters_are_the_callers_objects_in_a_new_list() -> None:
    params, grads = two_params()
    b = make_bucket(0, params, grads, is_last=True)
    assert all(p is q for p, q in zip(b.parameters(), params))
    lst = b.parameters()
    lst.clear()
    assert len(b.parameters()) == 2


def test_set_buffer_rebinds_without_copying_and_gradients_follow_the_new_dtype() -> None:
    b = bucket()
    new = b.buffer().to(torch.float16)
    assert b.set_buffer(new) is None
    assert b.buffer() is new
    assert [t.dtype for t in b.gradients()] == [torch.float16, torch.float16]
    new.mul_(2)
    assert b.gradients()[1].tolist() == [12.0, 14.0]


def test_set_buffer_longer_strided_and_offset_tensors_are_sliced_as_ddp_does() -> None:
    b = bucket()
    base = torch.arange(16.0)
    b.set_buffer(base)
    assert b.gradients()[1].tolist() == [6.0, 7.0]  # the first 8 elements count
    b.set_buffer(base[::2])
    assert b.gradients()[0].stride() == (6, 2)
    b.set_buffer(base[1:9])
    assert b.gradients()[0].storage_offset() == 1


@pytest.mark.parametrize(
    ("make", "torch_message"),
    [
        (lambda buf: buf[:-1].clone(), "shape '[2]' is invalid for input of size 1"),
        (lambda buf: torch.empty(0), "shape '[2, 3]' is invalid for input of size 0"),
        (lambda buf: buf.reshape(1, -1).clone(), "shape '[2, 3]' is invalid for input of size 8"),
        (lambda buf: torch.tensor(1.0), "slice() cannot be applied to a 0-dim tensor."),
    ],
    ids=["short", "empty", "2-d", "0-d"],
)
def test_gradients_after_an_incompatible_set_buffer_fail_loudly(make: Any, torch_message: str) -> None:
    b = bucket(index=4)
    b.set_buffer(make(b.buffer()))
    with pytest.raises(GradBucketRuntimeError) as info:
        b.gradients()
    msg = str(info.value)
    assert "bucket 4" in msg and "GradBucket.gradients()" in msg and torch_message in msg
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, HookFailure)
    with pytest.raises(GradBucketRuntimeError, match="get_per_parameter_tensors"):
        b.get_per_parameter_tensors()


@pytest.mark.parametrize("bad", [None, [torch.zeros(8)], 3, (torch.zeros(8),)])
def test_set_buffer_rejects_non_tensors(bad: Any) -> None:
    b = bucket(index=2)
    with pytest.raises(GradBucketTypeError, match=r"bucket 2: GradBucket.set_buffer\(\)") as info:
        b.set_buffer(bad)
    assert isinstance(info.value, TypeError)
    with pytest.raises(GradBucketTypeError, match="set_tensor"):
        b.set_tensor(bad)


def test_no_new_attributes_no_pickling_no_copying() -> None:
    b = bucket(index=5)
    with pytest.raises(GradBucketAttributeError, match="bucket 5: cannot set attribute 'state'"):
        b.state = 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        del b._index
    for action in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(GradBucketTypeError, match="bucket 5: cannot pickle or copy"):
            action(b)


def test_gradient_as_bucket_view_makes_p_grad_the_bucket_view() -> None:
    params, grads = two_params()
    b = make_bucket(0, params, grads, is_last=True, gradient_as_bucket_view=True)
    assert all(p.grad is not None and p.grad.data_ptr() == g.data_ptr() for p, g in zip(params, b.gradients()))
    b.buffer().add_(1)
    assert params[1].grad is not None and params[1].grad.tolist() == [7.0, 8.0]
    old = b.buffer()
    b.set_buffer(torch.zeros(8))
    assert params[0].grad is not None and params[0].grad.data_ptr() == old.data_ptr()
    params2, grads2 = two_params()
    make_bucket(0, params2, grads2, is_last=True)
    assert params2[0].grad is None


def test_repr_describes_the_bucket_deterministically() -> None:
    text = repr(bucket(index=7))
    assert text == repr(bucket(index=7))
    assert "index=7" in text and "0x" not in text


def test_torch_noop_hook_runs_on_a_sim_bucket() -> None:
    b = bucket()
    assert noop_hook(None, b).value() is b.buffer()


# ----------------------------------------------------------- legacy API
def test_legacy_methods_mirror_the_current_ones() -> None:
    params, grads = two_params()
    b = make_bucket(2, params, grads, is_last=True)
    tensors = b.get_tensors()
    assert len(tensors) == 1 and tensors[0] is b.buffer() and b.get_tensor() is b.buffer()
    assert b.get_tensors() is not tensors
    assert b.get_index() == 2
    assert all(p is q for p, q in zip(b.get_model_params_for_bucket(), params))
    new = torch.ones(8, dtype=torch.float64)
    b.set_tensor(new)
    assert b.buffer() is new
    assert [t.dtype for t in b.get_per_parameter_tensors()] == [torch.float64] * 2


def test_is_the_last_bucket_to_allreduce_is_index_0_as_in_torch_1_8() -> None:
    assert bucket(index=0, is_last=False).is_the_last_bucket_to_allreduce() is True
    assert bucket(index=3, is_last=True).is_the_last_bucket_to_allreduce() is False


def test_api_generations_hide_the_other_generations_methods() -> None:
    params, grads = two_params()
    current = make_bucket(1, params, grads, is_last=True, api="current")
    legacy = make_bucket(1, params, grads, is_last=True, api="legacy")
    assert not hasattr(current, "get_tensors") and hasattr(current, "buffer")
    assert hasattr(legacy, "get_tensors") and not hasattr(legacy, "buffer")
    with pytest.raises(GradBucketAttributeError, match=r"bucket 1: GradBucket.get_tensor\(\) exists only in torch 1.7-1.9"):
        current.get_tensor()
    with pytest.raises(GradBucketAttributeError, match=r"GradBucket.is_last\(\) exists only in torch >= 1.10"):
        legacy.is_last()
    assert "set_buffer" in dir(current) and "set_tensor" not in dir(current)


def test_the_other_generations_method_says_what_to_use_in_cli_terms() -> None:
    """A hook from the wild calls ``bucket.get_tensors()``: the report said 'Use api='both''
    — an option the CLI does not have, and a generation no torch ever was. It now names the
    current method to port to and ``--api legacy`` for a hook kept in the old style."""
    params, grads = two_params()
    current = make_bucket(1, params, grads, is_last=True, api="current")
    legacy = make_bucket(1, params, grads, is_last=True, api="legacy")
    with pytest.raises(GradBucketAttributeError) as info:
        current.get_tensors()
    text = str(info.value)
    assert "api='both'" not in text and "--api legacy" in text and "bucket.buffer()" in text
    with pytest.raises(GradBucketAttributeError) as info:
        legacy.is_last()
    text = str(info.value)
    assert "api='both'" not in text and "--api current" in text and "is_the_last_bucket_to_allreduce()" in text


# ----------------------------------------------------------- construction
def test_constructor_checks_the_packing() -> None:
    params, _ = two_params()
    with pytest.raises(UsageError, match="exactly 8 elements"):
        SimGradBucket(0, torch.zeros(7), params, is_last=True)
    with pytest.raises(UsageError, match="must be 1-D"):
        SimGradBucket(0, torch.zeros(2, 4), params, is_last=True)
    with pytest.raises(UsageError, match="torch.float32"):
        SimGradBucket(0, torch.zeros(8, dtype=torch.float64), params, is_last=True)
    buf = torch.zeros(8)
    gaps = [buf[0:6].view(2, 3), buf[5:7]]
    with pytest.raises(UsageError, match=r"gradients\[1\] must be the contiguous view buffer\[6:8\]"):
        SimGradBucket(0, buf, params, is_last=True, gradients=gaps)
    good = [buf[0:6].view(2, 3), buf[6:8]]
    assert SimGradBucket(0, buf, params, is_last=True, gradients=good).buffer() is buf
    mixed = [params[0], torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    with pytest.raises(UsageError, match="own buckets"):
        SimGradBucket(0, buf, mixed, is_last=True)
    for bad in (dict(index=-1), dict(index=True), dict(is_last=1), dict(api="new")):
        kw: dict[str, Any] = dict(index=0, is_last=True)
        kw.update(bad)
        with pytest.raises(UsageError):
            SimGradBucket(kw.pop("index"), buf, params, **kw)


def test_make_bucket_checks_grads_against_parameters() -> None:
    params, grads = two_params()
    with pytest.raises(UsageError, match=r"grads\[1\]"):
        make_bucket(0, params, [grads[0], torch.zeros(3)], is_last=True)
    with pytest.raises(UsageError, match="one gradient per parameter"):
        make_bucket(0, params, grads[:1], is_last=True)
    assert packing(params) == [(0, 6), (6, 2)]


# ------------------------------------------- against real GradBuckets on gloo
_OBSERVE = r'''
import copy
import torch
import torch.distributed as dist

CURRENT = ["buffer", "gradients", "index", "is_last", "parameters", "set_buffer"]
LEGACY = ["get_index", "get_model_params_for_bucket", "get_per_parameter_tensors", "get_tensor",
          "get_tensors", "is_the_last_bucket_to_allreduce", "set_tensor"]

def _error(fn):
    try:
        fn()
    except BaseException as e:
        return [isinstance(e, (RuntimeError, IndexError)),
                isinstance(e, TypeError), isinstance(e, AttributeError), str(e)]
    return None

def observe(bucket, params):
    """What a hook can see of a bucket; run on real and simulated buckets alike."""
    out = {}
    buf = bucket.buffer()
    out["index"], out["is_last"] = bucket.index(), bucket.is_last()
    out["buffer"] = [str(buf.dtype), list(buf.shape), buf.is_contiguous(), buf.storage_offset(), buf.tolist()]
    out["same_buffer_object"] = bucket.buffer() is buf
    grads = bucket.gradients()
    out["gradients"] = [[list(g.shape), g.storage_offset() - buf.storage_offset(), g.is_contiguous(),
                         g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), g.tolist()] for g in grads]
    out["fresh_views"] = bucket.gradients()[0] is not grads[0]
    ps = bucket.parameters()
    out["params"] = [next(i for i, q in enumerate(params) if q is p) for p in ps]
    out["fresh_param_list"] = bucket.parameters() is not ps
    out["p_grad_is_view"] = [p.grad is not None and p.grad.data_ptr() == g.data_ptr() for p, g in zip(ps, grads)]
    out["types"] = [type(bucket.index()).__name__, type(bucket.is_last()).__name__,
                    type(grads).__name__, type(ps).__name__]
    out["methods"] = [m for m in CURRENT + LEGACY if hasattr(bucket, m)]
    n = buf.numel()
    cases = {
        "float64": lambda: buf.double(), "float16": lambda: buf.half(), "int64": lambda: buf.long(),
        "longer": lambda: torch.cat([buf, buf]), "strided": lambda: torch.cat([buf, buf])[::2],
        "offset": lambda: torch.cat([buf, buf])[1:n + 1], "column": lambda: buf.reshape(n, 1).clone(),
        "shorter": lambda: buf[: n - 1].clone(), "row": lambda: buf.reshape(1, n).clone(),
        "empty": lambda: torch.empty(0), "0-d": lambda: torch.tensor(1.0),
    }
    for name, make in cases.items():
        x = make()
        bucket.set_buffer(x)
        seen = {"is_x": bucket.buffer() is x}
        try:
            seen["views"] = [[str(g.dtype), list(g.shape), g.stride(), g.storage_offset() - x.storage_offset(),
                              g.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()] for g in bucket.gradients()]
        except BaseException as e:
            seen["error"] = [isinstance(e, (RuntimeError, IndexError)), str(e)]
        out["set_buffer " + name] = seen
        bucket.set_buffer(buf)
    out["restored"] = bucket.buffer() is buf
    for name, bad in {"None": None, "list": [buf], "int": 3}.items():
        out["set_buffer(" + name + ")"] = _error(lambda: bucket.set_buffer(bad))[1]
    out["setattr"] = _error(lambda: setattr(bucket, "state", 1))[2]
    out["copy"] = _error(lambda: copy.copy(bucket))[1]
    return out
'''

def _observer() -> Any:
    """``observe`` from :data:`_OBSERVE` (the same code observes real and simulated buckets)."""
    ns: dict[str, Any] = {}
    exec(compile(_OBSERVE, "<observe>", "exec"), ns)
    return ns["observe"]


def _observe_real_ddp(view: bool, observe: Any) -> dict[str, Any]:
    """In a gloo rank: every bucket real DDP hands a recording hook, two iterations."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    params = list(model.parameters())
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.00002, gradient_as_bucket_view=view)
    seen = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotations that are strings
        grads = [p.grad.tolist() if p.grad is not None else None for p in bucket.parameters()]
        seen.append((observe(bucket, params), grads))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    x = torch.randn(4, 3)
    for _ in range(2):
        ddp(x).sum().backward()
    shapes = [list(p.shape) for p in params]
    del ddp  # docs/gloo-facts.md §10: no DDP object outlives the job (the runner then collects)
    return {"shapes": shapes, "seen": seen}


def real_bucket_job(rank: int, world_size: int, payload: None) -> list[dict[str, Any]]:
    """In each gloo rank: both ``gradient_as_bucket_view`` settings, with
    DDP_SET_LAST_BUCKET_CAP unset (it changes the layout) and restored afterwards."""
    saved = os.environ.pop("DDP_SET_LAST_BUCKET_CAP", None)
    try:
        observe = _observer()
        return [_observe_real_ddp(view, observe) for view in (False, True)]
    finally:
        if saved is not None:
            os.environ["DDP_SET_LAST_BUCKET_CAP"] = saved


def _same(real: Any, sim: Any, path: str = "") -> list[str]:
    """Differences between two observations; torch error text must appear in ours."""
    if isinstance(real, dict) and isinstance(sim, dict):
        if set(real) != set(sim):
            return [f"{path}: keys {sorted(real)} != {sorted(sim)}"]
        return [d for k in real for d in _same(real[k], sim[k], f"{path}.{k}")]
    if path.endswith(".error"):
        ok = real[0] == sim[0] and real[1] in sim[1]
        return [] if ok else [f"{path}: real {real!r} vs simulated {sim!r}"]
    return [] if real == sim else [f"{path}: real {real!r} vs simulated {sim!r}"]


@pytest.mark.gloo
def test_sim_bucket_matches_real_grad_buckets_inside_ddp(gloo_world: Callable[[int], GlooCluster]) -> None:
    observe = _observer()
    runs = gloo_world(1).run(real_bucket_job)[0]
    diffs: list[str] = []
    calls = 0
    for view, run in zip((False, True), runs):
        for real_obs, grads in run["seen"]:
            params = [torch.nn.Parameter(torch.zeros(s)) for s in run["shapes"]]
            mine = [params[i] for i in real_obs["params"]]
            sim = make_bucket(
                real_obs["index"],
                mine,
                [torch.tensor(g) for g in grads],
                is_last=real_obs["is_last"],
                gradient_as_bucket_view=view,
                api="current",
            )
            diffs += _same(real_obs, observe(sim, params), f"view={view} bucket {real_obs['index']}")
            calls += 1
    assert calls >= 4, "the run covers iteration 0 and several rebuilt buckets"
    assert not diffs, "\n".join(diffs)


def test_run_hook_default_parameter_is_one_zero_parameter_made_when_asked_and_kept() -> None:
    """run_hook's default buckets make their zero parameter lazily (a speed change): what a
    hook sees must be what an eager one was — one Parameter of the gradient's shape and
    dtype, all zeros, the same object on every call, gradients() viewing the buffer."""
    from simcluster import SimCluster
    from simcluster.fake.bucket import fresh_bucket

    seen: dict[int, list[Any]] = {}

    def hook(state: Any, bucket: Any) -> Any:
        first, second = bucket.parameters(), bucket.parameters()
        seen[bucket.index()] = [first, second, bucket.gradients(), repr(bucket)]
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    grad = torch.arange(6, dtype=torch.float64)
    SimCluster(1).run_hook(hook, [grad])
    first, second, grads, text = seen[0]
    assert len(first) == 1 and first[0] is second[0] and first is not second
    assert isinstance(first[0], torch.nn.Parameter) and first[0].dtype == torch.float64
    assert first[0].shape == grad.shape and not first[0].any()
    assert torch.equal(grads[0], grad) and "parameters=1" in text
    bucket = fresh_bucket(3, torch.ones(4, dtype=torch.float16), is_last=False)
    assert bucket.get_model_params_for_bucket()[0].dtype == torch.float16


def test_a_subclass_of_the_bucket_keeps_its_class_and_the_api_gating() -> None:
    class Mine(SimGradBucket):
        __slots__ = ()

    bucket = Mine(0, torch.zeros(2), [torch.zeros(2)], is_last=True, api="current")
    assert isinstance(bucket, Mine) and type(bucket).__name__ == "Mine"
    assert hasattr(bucket, "buffer") and not hasattr(bucket, "get_tensor")
    with pytest.raises(AttributeError, match=r"GradBucket.get_tensor\(\) exists only in torch 1.7-1.9"):
        bucket.get_tensor()
    assert type(Mine(0, torch.zeros(2), [torch.zeros(2)], is_last=True)) is Mine  # api="both": no gating class


def test_a_missing_method_is_named_on_torchs_type_as_real_ddp_names_it() -> None:
    """A tutorial's hook calls ``bucket.allreduce()``, which GradBucket never had. Real DDP
    (torch 2.13, gloo, world 1; docs/ddp-facts.md §1) raises AttributeError
    ``'torch._C._distributed_c10d.GradBucket' object has no attribute 'allreduce'``; the
    simulator named its own class (``'SimGradBucket' object …``), a type the user never wrote.
    A method of the other API generation keeps its advice."""
    params, grads = two_params()
    for api in ("both", "current", "legacy"):
        b = make_bucket(0, params, grads, is_last=True, api=api)
        with pytest.raises(AttributeError) as info:
            b.allreduce()
        assert str(info.value) == "'torch._C._distributed_c10d.GradBucket' object has no attribute 'allreduce'"
        assert not hasattr(b, "nope")
    current = make_bucket(0, params, grads, is_last=True, api="current")
    with pytest.raises(GradBucketAttributeError, match=r"get_tensors\(\) exists only in torch 1.7-1.9"):
        current.get_tensors()


def test_python_type_errors_name_torchs_bucket_type_as_real_ddp_does() -> None:
    """A FSDP-style hook ``hook(state, grad)`` handed a bucket calls ``dist.all_reduce(grad)``.
    Real DDP (torch 2.13, gloo, world 1; benchmarks/measure_bucket_type_errors.py,
    docs/ddp-facts.md §1) names ``torch._C._distributed_c10d.GradBucket`` in Python's own
    TypeErrors; the simulator named ``SimGradBucket``, a class the user never wrote."""
    params, grads = two_params()
    real = "torch._C._distributed_c10d.GradBucket"
    for api in ("both", "current", "legacy"):
        b = make_bucket(0, params, grads, is_last=True, api=api)
        assert isinstance(b, SimGradBucket) and repr(type(b)) == f"<class '{real}'>"
        with pytest.raises(TypeError, match=re.escape(f"but got <class '{real}'> instead.")):
            dist.all_reduce(b)
        with pytest.raises(TypeError, match=re.escape(f"'{real}' object is not subscriptable")):
            b[0]
        with pytest.raises(TypeError, match=re.escape(f"unsupported operand type(s) for /: '{real}' and 'int'")):
            b / 2
        with pytest.raises(TypeError, match=re.escape(f"object of type '{real}' has no len()")):
            len(b)
