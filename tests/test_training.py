"""Hooks that step an optimizer (ZeRO's hook_with_zero_step, _hook_then_optimizer), trained on
torch's real DDP on simulated groups and judged by ``trains_like_reference``; a ZeRO step that
skips one shard's update fails it; the hooks that stay skipped need an accelerator.
"""

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook, optimizer_overlap_hooks

from simcluster.checking.check import check_hook
from simcluster.checking.defaults import TORCH_HOOKS
from simcluster.checking.train_check import TrainExample, check_training, run_training
from simcluster.checking.training import TRAININGS, Heads, Training, trains_like_reference, zero_step_setup


def _skip_rank1_shard(ddp, group):
    """ZeRO whose rank 1 never applies its shard's update (it still broadcasts the stale shard)."""
    hook, state, step = zero_step_setup(ddp, group)
    if group.rank() == 1:
        zero = next(c.cell_contents for c in hook.__closure__ if type(c.cell_contents).__name__ ==
                    "ZeroRedundancyOptimizer")
        zero._local_step = lambda *args, **kwargs: None
    return hook, state, step


BROKEN_ZERO = Training("zero_skips_a_shard", _skip_rank1_shard, warmup=2, backends=("nccl",))


def test_zero_and_hook_then_optimizer_train_like_the_reference() -> None:
    for hook in (ddp_zero_hook.hook_with_zero_step, optimizer_overlap_hooks._hook_then_optimizer):
        report = check_hook(hook, examples=5, world_sizes=(1, 2, 3, 4))
        assert report.passed and report.properties == ["liveness", "trains_like_reference"], report.format()
        assert report.examples >= 5


def test_a_zero_step_that_skips_one_shard_fails_trains_like_reference() -> None:
    report = check_training(BROKEN_ZERO, target="broken", world_sizes=(2, 3), examples=8)
    assert [f.property for f in report.failures] == ["trains_like_reference"], report.format()
    failure = report.failures[0]
    assert failure.backend == "nccl" and "single-process reference" in failure.message
    assert "after iteration 2" in failure.message  # the first iteration ZeRO updates anything
    again = check_training(BROKEN_ZERO, target="broken", replay=failure.details["token"])
    assert [f.message for f in again.failures] == [failure.message]


def test_the_oracle_is_exact_before_the_first_update_and_catches_a_small_drift() -> None:
    example = TrainExample(world_size=2, sizes=(3, 2), cap_bytes=40, batch=2, seed=5)
    inputs = example.inputs(4)
    from simcluster.ddp.real_ddp import run_real_ddp

    run = run_real_ddp(example.model, inputs, world_size=2, hook=None, setup=TRAININGS["hook_with_zero_step"].setup,
                       iterations=4, bucket_cap_mb=40 / 2**20, backend="nccl")
    assert trains_like_reference(run.params, run.initial[0], inputs, Heads((3, 2)), warmup=2) is None
    # claiming an update in iteration 1, where ZeRO makes none, fails at once
    assert "after iteration 1" in str(trains_like_reference(run.params, run.initial[0], inputs, Heads((3, 2)),
                                                            warmup=1))
    run.params[3][1][0].view(-1)[0] += 1e-4  # rank 1 drifts by far less than one SGD step
    msg = trains_like_reference(run.params, run.initial[0], inputs, Heads((3, 2)), warmup=2)
    assert msg is not None and msg.startswith("after iteration 3: rank 1, param 0")


def test_the_default_run_trains_the_optimizer_hooks_and_says_why_the_others_are_skipped() -> None:
    rows = {e.name: e for e in TORCH_HOOKS}
    assert rows["hook_with_zero_step"].skipped is None and rows["hook_with_zero_step"].backends == ("nccl",)
    assert rows["_hook_then_optimizer"].skipped is None
    for name in ("_apply_optim_in_backward_hook", "_reducer_allreduce_and_upcast_hook"):
        assert "torch.accelerator.current_stream()" in rows[name].skipped
    assert "CollectiveMismatchError" in rows["hook_with_zero_step_interleaved"].skipped


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the skip reason is about machines without one")
def test_optimizer_in_backward_needs_an_accelerator_under_real_ddp() -> None:
    """The skip reason, measured: real DDP registers _apply_optim_in_backward_hook itself for
    parameters given to _apply_optimizer_in_backward, and its end-of-backward callback fails on CPU."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    from simcluster.ddp.real_ddp import run_real_ddp

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 2)
        _apply_optimizer_in_backward(torch.optim.SGD, linear.parameters(), {"lr": 0.1})
        return linear

    with pytest.raises(RuntimeError, match="Cannot access accelerator device when none is available"):
        run_real_ddp(model, [[torch.ones(2, 4)], [torch.ones(2, 4)]], world_size=2, hook=None, iterations=1)


def test_zero_is_refused_on_gloo_by_torch_and_not_run_there() -> None:
    report = check_hook(ddp_zero_hook.hook_with_zero_step, backends=("gloo",), examples=2)
    assert report.backends == [] and report.examples == 0 and report.status == "skipped"
    assert "Gloo backend using Overlapping DDP with ZeRO" in report.skipped


def test_run_training_reports_a_raising_hook_as_liveness() -> None:
    def setup(ddp, group):
        def hook(state, bucket):
            raise ValueError("boom")
        return hook, None, None

    with pytest.raises(AssertionError, match="ValueError: boom"):
        run_training(Training("raises", setup), TrainExample(2, (2,), 64, 1, 0), "gloo", 1)


def test_training_leaves_the_process_warning_state_as_it_found_it() -> None:
    """torch's rank threads swap warnings.filters concurrently (catch_warnings is not thread-safe):
    the check restores the filters and showwarning once the run is over."""
    import warnings

    before = (list(warnings.filters), warnings.showwarning)
    check_hook(optimizer_overlap_hooks._hook_then_optimizer, examples=2, world_sizes=(2, 3))
    assert (list(warnings.filters), warnings.showwarning) == before


def test_naming_trains_like_reference_for_a_plain_hook_is_a_usage_error_not_a_silent_pass() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from simcluster.errors import UsageError

    with pytest.raises(UsageError, match="trains_like_reference applies to hooks that step an optimizer"):
        check_hook(allreduce_hook, properties=["trains_like_reference"], examples=1)
