"""Lossy tolerances (scale=/norm=), fixed layouts (--params), model-aware state factories
and --subgroups with any state — each shown catching a real bug in a hook written for it
(tests/user_hooks.py) and passing the fixed hook.

No ``from __future__ import annotations``: the hooks below are registered with real DDP,
whose check compares annotations as objects.
"""

import contextlib
import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from simcluster.hooks.reference import TopKState
from simcluster.checking.check import check_hook
from simcluster.cli import main
from simcluster.fake.cluster import SimCluster
from simcluster.ddp.model import SimDDP
from simcluster.checking.defaults import QUANTIZATION_TOLERANCE, TORCH_HOOKS
from simcluster.errors import UsageError
from simcluster.checking.properties import averages
from simcluster.ddp.real_ddp import run_real_ddp
from simcluster.fake.state import LayoutModel, wants_model
from simcluster.checking.strategies import examples
from simcluster.usercode.targets import parse_shapes
from simcluster.checking.tolerances import Tolerance, lossy_averages, parse_tolerance, quantization_tolerance

HOOKS = str(Path(__file__).with_name("user_hooks.py"))
FAST = {"examples": 20, "world_sizes": (1, 2, 3, 4), "database": None}


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["check", *argv, "--no-database", "--quiet"])
    return code, out.getvalue() + err.getvalue()


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text, want", [
    ("scale=0.1", Tolerance("scale", ratio=0.1)),
    ("NORM = 0.5, atol=1e-6", Tolerance("norm", atol=1e-6, ratio=0.5)),
    ("atol=2,scale=0", Tolerance("scale", atol=2.0, ratio=0.0)),
    ("rtol=1e-3", Tolerance("explicit", rtol=1e-3)),
])
def test_lossy_tolerances_parse(text: str, want: Tolerance) -> None:
    assert parse_tolerance(text) == want


@pytest.mark.parametrize("text", ["scale", "scale=", "scale=-1", "scale=inf", "scale=1,norm=1", "scale=1,rtol=1",
                                  "scale=1,scale=2", "norm=x", "fp8"])
def test_bad_lossy_tolerances_are_one_line_usage_errors(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_tolerance(text, what="--tolerance")
    assert str(info.value).startswith(f"--tolerance {text!r}") and "\n" not in str(info.value)


# --------------------------------------------------------------------------- the lossy oracle
def test_scale_is_relative_to_the_buckets_own_largest_gradient() -> None:
    """A small parameter in its own bucket is judged against its own scale, not the model's."""
    inputs = [[torch.tensor([1000.0]), torch.tensor([1.0, 2.0])]] * 2
    results = [[torch.tensor([1000.0]), torch.tensor([1.0, 2.5])]] * 2  # 0.5 off in the small bucket
    assert lossy_averages(results, inputs, parse_tolerance("scale=0.1"), buckets=[[0, 1]]) is None
    msg = lossy_averages(results, inputs, parse_tolerance("scale=0.1"), buckets=[[0], [1]])
    assert msg is not None and "bucket 1 (params [1]), param 1 (shape (2,)), element 1" in msg
    assert "bound 0.2" in msg


def test_norm_bounds_the_buckets_l2_error_and_non_finite_results_fail() -> None:
    inputs = [[torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 4.0])]]  # mean norm 5
    near = [[torch.tensor([3.0, 3.0])]] * 2                             # error norm 1
    assert averages(near, inputs, "norm=0.2") is None
    msg = averages(near, inputs, "norm=0.1")
    assert msg is not None and "L2 error of the bucket's result is 1 > bound 0.5" in msg
    nan = [[torch.tensor([3.0, float("nan")])]] * 2
    assert "not finite" in str(averages(nan, inputs, "norm=10"))
    assert "not finite" in str(averages(nan, inputs, "scale=10"))


def test_groups_are_judged_separately() -> None:
    inputs = [[torch.tensor([1.0])], [torch.tensor([3.0])], [torch.tensor([10.0])], [torch.tensor([10.0])]]
    results = [[torch.tensor([2.0])], [torch.tensor([2.0])], [torch.tensor([10.0])], [torch.tensor([10.0])]]
    assert averages(results, inputs, "scale=0.01", groups=[[0, 1], [2, 3]]) is None
    assert "rank 0" in str(averages(results, inputs, "scale=0.01"))


# --------------------------------------------------------------------------- int8 quantizers
def test_a_correct_int8_quantizer_passes_scale_0_1() -> None:
    report = check_hook(f"{HOOKS}:int8_quantize_hook", tolerance="scale=0.1", **FAST)
    assert report.passed, report.format()
    assert "averages" in report.properties


def test_an_int8_quantizer_whose_sum_wraps_fails_scale_0_1() -> None:
    report = check_hook(f"{HOOKS}:int8_wrapping_hook", tolerance="scale=0.1", backends=("gloo",),
                        **{**FAST, "world_sizes": (2, 3)})
    failed = {f.property: f for f in report.failures}
    assert set(failed) == {"averages"}, report.format()
    assert failed["averages"].world_size >= 2 and "bucket's largest |gradient|" in failed["averages"].message
    again = check_hook(f"{HOOKS}:int8_wrapping_hook", tolerance="scale=0.1", replay=failed["averages"].details["token"])
    assert [f.message for f in again.failures] == [failed["averages"].message]


# --------------------------------------------------------------------------- torch's quantizers
def _worst(hook, world: int, gen: torch.Generator, trials: int) -> float:
    """The largest |result − mean| / (R_W·G + A_W) over drawn inputs, torch's hook on the NCCL model."""
    tol, worst = quantization_tolerance(world), 0.0
    for trial in range(trials):
        n = int(torch.randint(1, 1100, (1,), generator=gen))
        exp = int(torch.randint(-28, 16, (1,), generator=gen))
        grads = [(torch.rand(n, generator=gen) * 2 - 1) * 2.0**exp for _ in range(world)]
        if trial % 3 == 0:  # every rank the same values: the errors add up instead of averaging out
            grads = [grads[0].clone()] * world
        if trial % 4 == 1:  # values half a step off the grid: the worst case of rounding
            step = float(grads[0].abs().max()) * 2 / 255
            grads = [((torch.floor(g / step) + 0.5) * step).clamp(-step * 127.5, step * 127.5) for g in grads]
        run = SimCluster(world, seed=0, backend="nccl").run_hook(hook, grads, "group")
        mean = torch.stack([g.double() for g in grads]).mean(0)
        g_max = max(float(g.abs().max()) for g in grads)
        err = float((run.outputs[0].double()[:n] - mean).abs().max())
        worst = max(worst, err / (tol.ratio * g_max + tol.atol))
    return worst


@pytest.mark.parametrize("hook", [qh.quantization_pertensor_hook, qh.quantization_perchannel_hook])
def test_torch_quantization_hooks_meet_the_derived_bound_and_it_is_tight(hook) -> None:
    gen = torch.Generator().manual_seed(11)
    worst = {world: _worst(hook, world, gen, 12) for world in (1, 2, 3, 4, 8)}
    assert all(w <= 1.0 for w in worst.values()), worst
    assert max(worst.values()) >= 0.99, worst  # the bound is reached, not just respected
    assert quantization_tolerance(1).ratio < quantization_tolerance(8).ratio < 1 / 255 * 1.001


def test_the_default_rows_use_the_derived_bound_rounded_up() -> None:
    tol = parse_tolerance(QUANTIZATION_TOLERANCE)
    derived = quantization_tolerance(8)
    assert derived.ratio <= tol.ratio <= derived.ratio * 1.001 and derived.atol <= tol.atol <= derived.atol * 1.001
    rows = [e for e in TORCH_HOOKS if e.name.startswith("quantization_")]
    assert len(rows) == 2 and all(e.tolerance == QUANTIZATION_TOLERANCE and e.state == "group" for e in rows)


def test_torch_quantization_hook_returns_nan_when_a_bucket_spans_more_than_float32_max() -> None:
    """The documented limit of the scale= domain: max − min overflows, the step is inf, 0·inf is NaN."""
    run = SimCluster(1, seed=0, backend="nccl").run_hook(qh.quantization_pertensor_hook,
                                                          [torch.tensor([2e38, -2e38, 1.0])], "group")
    assert bool(run.outputs[0].isnan().all())


def test_torch_quantization_rows_pass_averages_on_nccl_and_fail_liveness_on_gloo() -> None:
    """Their callback raises IndexError on gloo: the hook's own exception, liveness (it was
    charged to contract until 2026-12-07: docs/properties.md)."""
    row = next(e for e in TORCH_HOOKS if e.name == "quantization_pertensor_hook")
    report = check_hook(row.target, state=row.state, tolerance=row.tolerance, examples=15, world_sizes=(2, 3),
                        database=None)
    assert "averages" in report.properties
    assert {(f.backend, f.property) for f in report.failures} == {("gloo", "liveness")}, report.format()
    assert "IndexError" in report.failures[0].message
    # the report says why in one line: gloo's all_gather future holds one tensor per rank
    hints = [line.strip() for line in report.format().splitlines() if "simcluster: hint:" in line]
    assert len(hints) == 1 and "all_gather#0" in hints[0] and "raises IndexError" in hints[0], report.format()


# --------------------------------------------------------------------------- --params
@pytest.mark.parametrize("text, want", [("4x5,5,1000", ((4, 5), (5,), (1000,))), (" 2X3x4 ", ((2, 3, 4),))])
def test_parse_shapes(text: str, want: tuple) -> None:
    assert parse_shapes(text) == want


@pytest.mark.parametrize("text", ["4x0", "", "4x", "a", "4,,5", "-3", "99999x99999"])
def test_bad_shapes_are_one_line_usage_errors(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_shapes(text)
    assert str(info.value).startswith(f"--params {text!r}") and "\n" not in str(info.value)
    code, out = _cli("simcluster.hooks.reference:mean_allreduce_hook", "--params", text)
    assert code == 2 and "--params" in out


@settings(max_examples=30, database=None, deadline=None)
@given(examples(params=[(4, 5), (5,)], world_size_choices=(1, 2, 3)))
def test_fixed_shapes_still_draw_caps_and_orders(example) -> None:
    assert example.layout.shapes == ((4, 5), (5,))
    assert sorted(example.layout.ready_order) == [0, 1]


def test_fixed_shapes_reach_the_hook_and_the_replay_line() -> None:
    seen = set()

    def recording_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.update(tuple(p.shape) for p in bucket.parameters())
        return allreduce_hook(process_group, bucket)

    report = check_hook(recording_hook, params=[(4, 5), (5,)], supervise=False, **FAST)  # in-process: sees `seen`
    assert report.passed and seen == {(4, 5), (5,)}

    def broken(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() * 2)
        return fut

    failed = check_hook(broken, params="3x2,7", backends=("gloo",), **{**FAST, "world_sizes": (2,)}).failures[0]
    assert "params [(3, 2), (7,)]" in failed.layout and "--params 3x2,7" in failed.replay


def test_the_plugin_passes_params_and_subgroups(monkeypatch: pytest.MonkeyPatch) -> None:
    from simcluster import plugin

    seen = {}
    monkeypatch.setattr("simcluster.checking.check.check_hook", lambda hook, **kw: seen.update(kw))
    plugin.check_hook("simcluster.hooks.reference:mean_allreduce_hook", params="4x5,5", subgroups=True)
    assert seen["params"] == ((4, 5), (5,)) and seen["subgroups"] is True
    with pytest.raises(UsageError):
        check_hook(allreduce_hook, params=[(4, 0)], **FAST)


# --------------------------------------------------------------------------- model-aware state
def test_which_factories_get_the_model() -> None:
    def kw_only(process_group, *, model):
        return model

    assert wants_model(lambda pg, model: 0) and wants_model(lambda pg, m: 0) and wants_model(kw_only)
    assert not wants_model(lambda pg: 0) and not wants_model(lambda pg, k=4: 0) and not wants_model(TopKState)


def test_a_two_argument_factory_gets_a_model_of_ddps_own_parameters() -> None:
    models = {}

    def factory(process_group, model):
        models[process_group.rank()] = model
        return process_group

    ddp = SimDDP(SimCluster(2), allreduce_hook, [(3, 2), (4,)], state=factory)
    ddp.step([[torch.ones(3, 2), torch.ones(4)]] * 2)
    for rank in (0, 1):
        assert isinstance(models[rank], LayoutModel)
        assert [id(p) for p in models[rank].parameters()] == [id(p) for p in ddp.params[rank]]
    assert models[0] is not models[1]


def test_real_ddp_gives_a_two_argument_factory_the_ranks_module() -> None:
    seen = {}

    def factory(process_group, model):
        seen[process_group.rank()] = [tuple(p.shape) for p in model.parameters()]
        return process_group

    build = lambda: torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))  # noqa: E731
    run_real_ddp(build, [[torch.ones(2, 4)], [torch.zeros(2, 4)]], world_size=2, hook=allreduce_hook,
                 state=factory, iterations=1)
    assert seen == {0: [(3, 4), (3,), (1, 3), (1,)], 1: [(3, 4), (3,), (1, 3), (1,)]}


def test_a_sketch_sized_from_the_model_runs_from_the_cli_with_params() -> None:
    common = (f"{HOOKS}:sketch_hook", "--state", f"{HOOKS}:make_sketch_state", "--tolerance", "none",
              "--examples", "10", "--world-sizes", "1,2,3")
    code, out = _cli(*common, "--params", "64,8x8")
    assert code == 0, out
    code, out = _cli(*common)  # drawn tiny layouts: the default compression cannot sketch (1,)
    assert code == 1 and "too small to sketch" in out


# --------------------------------------------------------------------------- --subgroups
def test_a_hook_using_global_ranks_fails_on_subgroups_with_a_factory_state() -> None:
    options = dict(state=f"{HOOKS}:GroupState", tolerance="scale=0.1", **{**FAST, "examples": 10})
    assert check_hook(f"{HOOKS}:global_rank_hook", **options).passed  # the whole world: right by luck
    # 40 examples: enough draws to split the world (ten may all draw one group)
    report = check_hook(f"{HOOKS}:global_rank_hook", subgroups=True, backends=("gloo",),
                        **{**options, "world_sizes": (2, 4), "examples": 40})
    failure = report.failures[0]
    assert not report.passed and "IndexError" in failure.message and "subgroups of" in failure.layout
    assert "--subgroups" in failure.replay
    assert check_hook(f"{HOOKS}:group_rank_hook", subgroups=True, **options).passed


def test_subgroups_from_the_cli() -> None:
    code, out = _cli(f"{HOOKS}:global_rank_hook", "--state", f"{HOOKS}:GroupState", "--tolerance", "scale=0.1",
                     "--subgroups", "--examples", "40", "--world-sizes", "2,4", "--backend", "nccl")
    assert code == 1 and "IndexError" in out and "--subgroups" in out
