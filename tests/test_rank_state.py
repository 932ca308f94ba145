"""A simulated rank owns what a process owns: module state, Python/numpy RNGs; shared settings are caught.

The hooks under test live in ``tests/rank_state_hooks/`` and are loaded by path, as a
user's would be.
"""

from __future__ import annotations

import os
import platform
import random
import re
import resource
import subprocess
import warnings
import signal
import sys
import threading
import types
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed as dist
import torch.utils.deterministic

from simcluster import SimCluster
from simcluster.checking.check import check_hook, decode_example, encode_example
from simcluster.real.differential import compare_with_gloo
from simcluster.errors import SharedSettingError, UsageError
from simcluster.usercode.rank_local import RankLocal
from simcluster.usercode import rank_state
from simcluster.usercode.rank_state import SettingsAudit
from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec
from simcluster.usercode.targets import load_target

HOOKS = Path(__file__).parent / "rank_state_hooks"
CORRECT = ["counter_dtype", "module_random", "residual_dict"]
ROOT = Path(__file__).parent.parent


def spec(name: str) -> str:
    return f"{HOOKS / name}.py:hook"


# -- per-rank module copies ------------------------------------------------------------------


@pytest.mark.parametrize("name", CORRECT)
def test_hooks_correct_per_process_pass_check(name: str) -> None:
    report = check_hook(spec(name), world_sizes=(2, 3, 4, 8), examples=12, backends=("gloo",), database=None)
    assert report.passed, report.format()


@pytest.mark.slow
@pytest.mark.parametrize("name", CORRECT)
def test_hooks_correct_per_process_pass_check_200_examples(name: str) -> None:
    report = check_hook(spec(name), world_sizes=(2, 3, 4, 8), examples=200, database=None)
    assert report.passed, report.format()


@pytest.mark.parametrize("name", CORRECT)
def test_the_same_hooks_as_shared_function_objects_are_false_alarms(name: str) -> None:
    """What the copies prevent: one module shared by every rank breaks these correct hooks."""
    report = check_hook(load_target(spec(name)), world_sizes=(4,), examples=3, backends=("gloo",), database=None)
    assert [f.property for f in report.failures] == ["liveness"]
    assert "CollectiveMismatchError" in report.failures[0].message


def test_each_cluster_is_a_fresh_set_of_processes() -> None:
    hook = RankLocal(spec("counter_dtype"))
    shared_calls = dict(hook.shared.__globals__["_calls"])
    grads = [torch.ones(3), torch.ones(3)]
    for _ in range(2):  # two clusters: each starts from a fresh module (the counter at 0)
        cluster = SimCluster(2, seed=0)
        dtypes = [cluster.run_hook(hook, grads).trace.collectives()[0].dtype for _ in range(3)]
        assert dtypes == ["float32", "float32", "float64"]
    assert hook.shared.__globals__["_calls"] == shared_calls  # the shared module untouched


def test_portable_spells_a_file_spec_by_its_absolute_path_and_runs_the_same_copies() -> None:
    roundabout = RankLocal(f"{HOOKS}/../{HOOKS.name}/counter_dtype.py:hook")
    portable = roundabout.portable()
    assert portable.spec == f"{(HOOKS / 'counter_dtype.py').resolve()}:hook" == roundabout.portable_spec
    assert roundabout.spec.startswith(f"{HOOKS}/../")  # the original keeps its spelling
    grads = [torch.ones(3), torch.ones(3)]
    dtypes = [SimCluster(2).run_hook(portable, grads).trace.collectives()[0].dtype for _ in range(3)]
    assert dtypes == ["float32"] * 3  # a fresh copy per cluster, as RankLocal(portable_spec) gives
    module = RankLocal("simcluster.hooks.reference:mean_allreduce_hook")
    assert module.portable() is module


def test_a_torch_compiled_helper_runs_in_every_ranks_copy_and_every_cluster() -> None:
    """Dynamo caches on the code object and installs ``__compiled_fn_N`` in the globals of the
    copy that ran it first: with code objects shared by the copies, the next rank (or the next
    cluster's rank 0) raised ``NameError: name '__compiled_fn_…' is not defined`` — reported
    as the hook's liveness failure on a correct hook from the wild."""
    hook = RankLocal(spec("compiled_helper"))
    for _ in range(2):  # a second cluster: fresh copies again
        run = SimCluster(2).run_hook(hook, [torch.ones(3), 3 * torch.ones(3)])
        assert [o.tolist() for o in run.outputs] == [[2.0] * 3, [2.0] * 3]


def test_hook_and_state_factory_of_one_file_share_the_rank_copy(tmp_path: Path) -> None:
    source = tmp_path / "paired.py"
    source.write_text(
        "import torch, torch.distributed as dist\n"
        "class State:\n    pass\n"
        "def make_state(pg):\n    return State()\n"
        "def hook(state, bucket):\n"
        "    assert isinstance(state, State), 'state from another copy of the module'\n"
        "    fut = torch.futures.Future(); fut.set_result(bucket.buffer()); return fut\n")
    cluster = SimCluster(2)
    run = cluster.run_hook(f"{source}:hook", [torch.ones(2), torch.ones(2)],
                           state=RankLocal(f"{source}:make_state"))
    assert type(run.states[0]) is not type(run.states[1])  # each rank its own class object


def test_isolate_copies_a_helper_module_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HOOKS))
    options = dict(world_sizes=(4,), examples=3, backends=("gloo",), database=None)
    shared = check_hook("rspkg.hooks:hook", **options)
    assert [f.property for f in shared.failures] == ["liveness"]  # the helper's counter is shared
    import rspkg.helpers

    before = dict(rspkg.helpers.calls)
    isolated = check_hook("rspkg.hooks:hook", isolate="rspkg.helpers", **options)
    assert isolated.passed, isolated.format()
    assert sys.modules["rspkg.helpers"] is rspkg.helpers and rspkg.helpers.calls == before  # copies only


def test_isolate_refuses_shared_packages() -> None:
    with pytest.raises(UsageError, match="torch.nn is part of torch, which every rank shares"):
        check_hook("simcluster.hooks.reference:mean_allreduce_hook", isolate="torch.nn")


@pytest.mark.parametrize("name", CORRECT)
def test_hooks_agree_bitwise_with_real_gloo(name: str, gloo_world) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(9, generator=gen) for _ in range(4)] for _ in range(4)]
    report = compare_with_gloo(spec(name), grads, world_size=4, cluster=gloo_world(4))
    assert report.equal, report.summary()
    again = compare_with_gloo(spec(name), grads, world_size=4, cluster=gloo_world(4))  # fresh modules per job
    assert again.equal, again.summary()


# -- per-rank random / numpy -------------------------------------------------------------------


def _draws(rank: int) -> tuple[list[float], list[float]]:
    first = [random.random(), float(numpy.random.rand())]
    dist.barrier()  # the other ranks draw in between
    return first, [random.random(), float(numpy.random.rand())]


def test_random_and_numpy_are_per_rank_and_seeded_by_policy() -> None:
    random.seed(5)
    numpy.random.seed(5)
    outside = (random.getstate(), numpy.random.get_state()[1].copy())
    values = SimCluster(3, seed=7).run(_draws).values
    for rank, (first, second) in enumerate(values):
        py, np_ = random.Random(7 + rank), numpy.random.RandomState(7 + rank)
        assert [first[0], second[0]] == [py.random(), py.random()]
        assert [first[1], second[1]] == [np_.rand(), np_.rand()]
    same = SimCluster(3, seed=7, rng="same").run(_draws).values
    assert same[0] == same[1] == same[2]
    assert random.getstate() == outside[0] and (numpy.random.get_state()[1] == outside[1]).all()


def _every_generator(rank: int) -> tuple[float, float, float]:
    return float(torch.rand(())), random.random(), float(numpy.random.rand())


@pytest.mark.parametrize("seed", [7, 2**32 - 2])  # rank 2: seed + rank past numpy's 2**32 - 1, folded alike
def test_a_real_process_seeded_for_a_rank_draws_what_that_simulated_rank_draws(seed: int) -> None:
    """The e2e and gloo-differential children seed their generators with
    seed_process_generators: a hook drawing from any of the three generators must draw the
    same on both sides, or every comparison is a false fidelity alarm."""
    simulated = SimCluster(3, seed=seed).run(_every_generator).values
    saved = rank_state.process_generator_states()
    try:
        for rank in range(3):
            rank_state.seed_process_generators(seed, rank)
            assert _every_generator(rank) == simulated[rank]
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        numpy.random.set_state(saved[2])


def test_example_seeds_reach_the_ranks_and_tokens_carry_them() -> None:
    example = Example(2, Layout(((3,),)), StepSpec((RankSpec("ints", seed=1), RankSpec("ints", seed=2))),
                      rng_seed=123)
    assert decode_example(encode_example(example, "gloo"))[0].rng_seed == 123
    old = Example(2, Layout(((3,),)), StepSpec((RankSpec("ints", seed=1), RankSpec("ints", seed=2))))
    token = encode_example(old, "gloo")
    assert decode_example(token)[0] == old  # a token without the field decodes (None: the --seed)
    import base64
    import zlib

    body = token[4:]
    assert b"rng_seed" not in zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


# -- shared settings ---------------------------------------------------------------------------


def test_a_rank_changing_the_default_dtype_is_reported_and_undone() -> None:
    def rank_fn(rank: int) -> None:
        if rank == 1:
            torch.set_default_dtype(torch.float64)
        dist.barrier()

    with pytest.raises(SharedSettingError, match=r"rank 1 changed torch.get_default_dtype\(\) from torch.float32"):
        SimCluster(2).run(rank_fn)
    assert torch.get_default_dtype() == torch.float32


def test_a_rank_changing_a_backend_flag_is_reported_and_undone() -> None:
    def rank_fn(rank: int) -> None:
        if rank == 1:
            torch.backends.cudnn.deterministic = True

    with pytest.raises(SharedSettingError, match=r"rank 1 changed torch.backends.cudnn"):
        SimCluster(2).run(rank_fn)
    assert torch.backends.cudnn.deterministic is False


def test_a_rank_changing_os_environ_is_reported_and_undone() -> None:
    def rank_fn(rank: int) -> None:
        if rank == 0:
            os.environ["SIMCLUSTER_TEST_LEAK"] = "1"

    with pytest.raises(SharedSettingError, match="rank 0 changed os.environ: SIMCLUSTER_TEST_LEAK set"):
        SimCluster(2).run(rank_fn)
    assert "SIMCLUSTER_TEST_LEAK" not in os.environ


def test_the_environ_mutation_stamp_moves_at_every_kind_of_change() -> None:
    """The audit compares ``os.environ`` with its snapshot only when the dict's mutation stamp
    moved: a change that left the stamp still would be missed (where no stamp is trusted the
    audit compares at every switch, and this test has nothing to check)."""
    data: dict[bytes, bytes] = {b"A": b"1"}
    stamp = rank_state._mutation_stamp(data)
    if stamp is None:
        pytest.skip("no trusted dict version tag on this interpreter: the audit compares at every switch")
    seen = [stamp()]
    for change in (lambda: data.__setitem__(b"B", b"2"), lambda: data.__setitem__(b"A", b"other"),
                   lambda: data.pop(b"B"), lambda: data.update({b"C": b"3"}), lambda: data.setdefault(b"D", b"4"),
                   data.popitem, data.clear):
        change()
        seen.append(stamp())
        assert seen[-1] != seen[-2], f"the stamp stood still after change {len(seen) - 1}"


def test_a_change_to_os_environ_after_many_quiet_switches_is_still_caught() -> None:
    """Switches that find ``os.environ`` untouched skip the comparison; the rank that writes
    after them is still named, with the launcher model's own writes at every switch too."""
    def rank_fn(rank: int) -> None:
        if rank == 3:
            os.environ.pop("SIMCLUSTER_TEST_GONE", None)
            os.environ["SIMCLUSTER_TEST_LATE"] = "x"

    os.environ["SIMCLUSTER_TEST_GONE"] = "here"
    try:
        for launcher in ("none", "torchrun"):
            with pytest.raises(SharedSettingError, match="rank 3 changed os.environ: .*SIMCLUSTER_TEST_LATE set"):
                SimCluster(5, launcher=launcher).run(rank_fn)
            assert "SIMCLUSTER_TEST_LATE" not in os.environ
            assert os.environ["SIMCLUSTER_TEST_GONE"] == "here"
    finally:
        del os.environ["SIMCLUSTER_TEST_GONE"]


def _settings() -> tuple[object, ...]:
    """What the hooks of ``shared_settings.py`` change, as seen from the test's thread."""
    return (5e-324 * 1.0 == 0.0, str(torch.get_default_device()), torch._C._len_torch_function_stack(),
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            os.getcwd(), list(sys.path), sys.getrecursionlimit(), torch.is_anomaly_enabled(),
            torch.is_anomaly_check_nan_enabled(), sys.stdout, sys.stderr, torch.backends.mkldnn.enabled,
            torch._C._get_nnpack_enabled(), torch.utils.deterministic.fill_uninitialized_memory, sys.gettrace(),
            sys.getprofile(), sys.excepthook, sys.unraisablehook, threading.excepthook, signal.getsignal(signal.SIGUSR1),
            _attributes(dist), _attributes(torch.futures), signal.getitimer(signal.ITIMER_REAL)[1],
            resource.getrlimit(resource.RLIMIT_NOFILE))


def _attributes(module: types.ModuleType) -> dict[str, object]:
    """``module``'s attributes but its submodules: an import inside a run (torch imports
    ``torch.distributed.tensor`` and others lazily, the first time some calls run) adds those,
    as it would in every process, and they stay."""
    return {k: v for k, v in vars(module).items() if not isinstance(v, types.ModuleType)}


def _run_shared(name: str) -> str:
    """Run hook ``name`` of ``shared_settings.py`` on 3 ranks; the SharedSettingError's text."""
    before = _settings()
    with pytest.raises(SharedSettingError) as caught:
        SimCluster(3, seed=0).run_hook(f"{HOOKS / 'shared_settings.py'}:{name}", [torch.ones(4)] * 3)
    assert _settings() == before  # put back
    return str(caught.value)


X86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                         reason="the flush-denormal probe reads x86's MXCSR DAZ/FTZ bits")
FLUSH = "torch.set_flush_denormal (the thread's DAZ/FTZ bits)"


@pytest.mark.parametrize("name, report", [
    pytest.param("flush_denormal", f"rank 1 changed {FLUSH} from False to True while its code ran:", marks=X86),
    ("default_device", "rank 1 changed torch.get_default_device() from cpu to meta (+1 torch function mode(s)) "
                       "while its code ran:"),
    ("device_block_left_open", "rank 1 changed torch.get_default_device() from cpu to meta (+1 torch function "
                               "mode(s)) while its code ran:"),
    ("warn_only", "rank 1 changed torch.are_deterministic_algorithms_enabled() from False to 'warn_only' while its "
                  "code ran:"),
])
def test_a_rank_changing_a_setting_read_at_every_switch_is_named_and_undone(name: str, report: str) -> None:
    message = _run_shared(name)
    assert message.startswith(report), message
    assert "more change" not in message  # one change, reported once


@pytest.mark.parametrize("name, setting", [
    ("chdir", "os.getcwd()"),
    ("sys_path", "sys.path"),
    ("recursion_limit", "sys.getrecursionlimit()"),
    ("anomaly", "torch.is_anomaly_enabled() (and check_nan, while enabled)"),
    ("stdout", "sys.stdout, sys.stderr"),
    ("mkldnn", "torch.backends.mkldnn.enabled"),
    ("nnpack", "torch.backends.nnpack (torch._C._get_nnpack_enabled())"),
    ("fill_uninitialized_memory", "torch.utils.deterministic.fill_uninitialized_memory"),
    ("trace_function", "sys.gettrace(), sys.getprofile() (the run's thread)"),  # a tracer left behind ran in
    ("profile_function", "sys.gettrace(), sys.getprofile() (the run's thread)"),  # simcluster's code, and all ranks'
    # what prints an uncaught error, and signal handlers: a rank's own on a real cluster
    ("excepthook", "sys.excepthook, sys.unraisablehook, threading.excepthook"),
    ("unraisablehook", "sys.excepthook, sys.unraisablehook, threading.excepthook"),
    ("threading_excepthook", "sys.excepthook, sys.unraisablehook, threading.excepthook"),
    ("signal_handler", "signal handlers (signal.getsignal)"),
    # a module's attribute a rank replaced, added or deleted (an audit of hostile hooks: rank 0
    # alone wrapping dist.all_reduce passed, where real gloo gave other gradients)
    ("patched_all_reduce", "torch.distributed.all_reduce"),
    ("marked_torch_distributed", "torch.distributed._simcluster_test_patched"),
    ("deleted_from_torch_futures", "torch.futures.wait_all"),
    ("hidden_module", "sys.modules['numpy']"),  # Hypothesis' next draw broke: an internal error, a traceback
    # an armed timer and a lowered limit ended a later example's process, or not, by timing
    ("interval_timer", "interval timers (signal.setitimer, signal.alarm)"),
    ("file_limit", "resource limits (resource.getrlimit)"),
])
def test_a_rank_changing_a_setting_read_once_per_run_is_reported_for_the_run_and_undone(name: str,
                                                                                        setting: str) -> None:
    message = _run_shared(name)
    assert message.startswith(f"a rank changed {setting} from "), message
    assert " during the run (read when the run starts and ends, not at every rank switch: which rank is not " \
           "known): simulated ranks share this process-wide setting" in message, message


def test_the_run_settings_report_says_what_changed() -> None:
    assert "from 1 to 1123" not in _run_shared("recursion_limit")  # the limit, not a count
    limit = sys.getrecursionlimit()
    assert f"from {limit} to {limit + 123} during the run" in _run_shared("recursion_limit")
    assert "entries, added ['/simcluster-test-nowhere'] during the run" in _run_shared("sys_path")
    assert f"from {os.getcwd()!r} to {str(HOOKS)!r} during the run" in _run_shared("chdir")
    assert "from (None, None) to (None, _count_events) during the run" in _run_shared("profile_function")
    assert "from (SIGUSR1: SIG_DFL) to (SIGUSR1: _log_and_exit) during the run" in _run_shared("signal_handler")
    patched = _run_shared("patched_all_reduce")
    assert "from torch.distributed.distributed_c10d.all_reduce to _divide_first at " in patched, patched
    assert "0x" not in patched and "simcluster_target" not in patched  # no address, no private module name
    assert "torch.distributed._simcluster_test_patched from (not set) to True" in _run_shared(
        "marked_torch_distributed")
    assert "sys.modules['numpy'] from module numpy to None during the run" in _run_shared("hidden_module")
    streams = _run_shared("stdout")
    assert " to (StringIO, " in streams and "0x" not in streams  # named by type: the same text every run


def test_a_rank_replacing_what_simcluster_patches_for_a_run_is_reported_in_any_run() -> None:
    """simcluster sets ``dist.new_group`` and ``torch.futures.Future`` for each run and puts
    them back after it, outside the settings audit. A rank's own replacement of either, in a
    cluster's third run, is still named and undone, and torch's originals are back after."""
    originals = (dist.new_group, torch.futures.Future)
    cluster = SimCluster(2, seed=0)
    for _ in range(2):
        cluster.run(lambda rank: None)

    def replaces(rank: int) -> None:
        if rank == 1:
            dist.new_group = lambda *args, **kwargs: None
            torch.futures.Future = type("Mine", (), {})

    with pytest.raises(SharedSettingError) as caught:
        cluster.run(replaces)
    message = str(caught.value)
    assert "a rank changed torch.distributed.new_group from simcluster." in message, message
    assert "(1 more change(s) after it)" in message, message  # torch.futures.Future
    assert (dist.new_group, torch.futures.Future) == originals
    cluster.run(lambda rank: None)  # the audit's snapshot is right again: a quiet run passes


def test_what_a_rank_module_copys_import_changes_is_the_baseline_not_a_shared_setting() -> None:
    """A hook file's ``sys.path.insert`` and ``sys.setrecursionlimit`` at its top run when each
    rank imports its copy, inside the run: what every process's import does. It was reported
    as a SharedSettingError (exit 2: the hook could not be checked); a change made when the
    hook is called still is."""
    path, limit = list(sys.path), sys.getrecursionlimit()
    try:
        run = SimCluster(3, seed=0).run_hook(f"{HOOKS / 'import_time_settings.py'}:hook", [torch.ones(4)] * 3)
        assert [out.tolist() for out in run.outputs] == [[1.0] * 4] * 3
        with pytest.raises(SharedSettingError, match=r"a rank changed sys\.path from \d+ entries to \d+ entries, "
                                                     r"added \['/simcluster-test-nowhere-either'\] during the run"):
            SimCluster(3, seed=0).run_hook(
                f"{HOOKS / 'import_time_settings.py'}:hook_that_also_changes_the_path_when_called", [torch.ones(4)] * 3)
    finally:
        sys.path[:] = path
        sys.setrecursionlimit(limit)


def test_a_wrapper_a_rank_module_copys_import_puts_around_all_reduce_is_that_ranks_alone() -> None:
    """Each rank's copy of a hook file that wraps ``dist.all_reduce`` at its top wrapped the
    shared one, on top of the copies before it (and every earlier cluster's): rank r's call ran
    r + 1 wrappers. A process imports its code once: each rank runs its own wrapper, once;
    torch's function is back outside the run, and so after the TARGET's shared import."""
    from simcluster.usercode.targets import load_target

    target = f"{HOOKS / 'import_wraps_all_reduce.py'}:hook"
    own = dist.all_reduce
    load_target(target)
    assert dist.all_reduce is own
    for _ in range(2):  # a second cluster's copies wrap torch's function again, not the first's wrappers
        run = SimCluster(3, seed=0).run_hook(target, [torch.zeros(2)] * 3)
        assert [out.tolist() for out in run.outputs] == [[3.0, 3.0]] * 3  # was [[6.0, 6.0]] * 3, then 12
        assert dist.all_reduce is own


@X86
def test_flush_denormal_set_before_a_wait_is_the_waiting_ranks_and_reported_once() -> None:
    # rank 1 parks in its hook; the thread that runs the others next was started from
    # rank 1's and inherits its FPU bits: rank 1's change, reported once
    message = _run_shared("flush_denormal_then_wait")
    assert message.startswith(f"rank 1 changed {FLUSH} from False to True while its code ran:"), message
    assert "more change" not in message


@X86
def test_a_thread_started_while_a_rank_waits_does_not_pass_its_flush_bits_on() -> None:
    seen: dict[int, bool] = {}

    def rank_fn(rank: int) -> None:
        seen[rank] = 5e-324 * 1.0 == 0.0  # do this rank's floats flush denormals?
        if rank == 1:
            torch.set_flush_denormal(True)
        dist.barrier()  # rank 1 parks; rank 2 runs on a thread started from rank 1's

    with pytest.raises(SharedSettingError, match=f"rank 1 changed {re.escape(FLUSH)} from False to True"):
        SimCluster(3, seed=0).run(rank_fn)
    assert seen == {0: False, 1: False, 2: False}


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize("name", ["tidy", "tidy_across_a_wait"])
def test_a_hook_restoring_what_it_changes_within_its_turn_passes(name: str) -> None:
    before = _settings()
    run = SimCluster(3, seed=0).run_hook(f"{HOOKS / 'shared_settings.py'}:{name}", [torch.ones(4)] * 3)
    assert [out.tolist() for out in run.outputs] == [[1.0] * 4] * 3
    assert _settings() == before


def test_thread_settings_are_blamed_on_the_rank_that_last_ran_on_that_thread() -> None:
    # The engine's thread hand-overs, played by hand: ``check(old, new)`` is called on the
    # thread about to run ``new``'s code. Rank 1's code runs on thread T and leaves a
    # ``torch.device`` block open; T then goes idle while the caller's thread runs rank 2;
    # T later runs rank 0's code: rank 1 changed it (not rank 2, the rank that stopped).
    audit = SettingsAudit()
    audit.start()  # rank 0 enters on this thread
    with ThreadPoolExecutor(1) as t:
        t.submit(audit.check, 0, 1).result()
        t.submit(lambda: torch.device("meta").__enter__()).result()  # rank 1's code on T
        audit.check(1, 2)  # rank 2 on the caller's thread
        t.submit(audit.check, 2, 0).result()  # rank 0 on T: sees rank 1's mode
        assert t.submit(torch._C._len_torch_function_stack).result() == 0  # undone on T
    assert audit.changes == [("torch.get_default_device()", 1, "cpu", "meta (+1 torch function mode(s))")]


def test_a_rank_resuming_on_its_own_thread_keeps_its_thread_settings() -> None:
    # Rank 1 enters ``with torch.device(...)`` on T and waits (T parks); rank 2 runs on the
    # caller's thread; rank 1 resumes on T, where nobody else ran: its block is its own.
    audit = SettingsAudit()
    audit.start()
    with ThreadPoolExecutor(1) as t:
        t.submit(audit.check, 0, 1).result()
        mode = t.submit(lambda: torch.device("meta").__enter__()).result()
        audit.check(1, 2)
        t.submit(audit.check, 2, 1).result()  # rank 1 resumes on T
        assert t.submit(torch._C._len_torch_function_stack).result() == 1  # left alone
        t.submit(mode.__exit__, None, None, None).result()
        t.submit(audit.check, 1, 2).result()
    assert audit.changes == []


# -- replays reproduce -------------------------------------------------------------------------


def _cli(args: list[str], hashseed: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONHASHSEED=str(hashseed), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "simcluster", "check", *args, "--quiet", "--no-database"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _replay_reproduces(name: str, runs: int) -> None:
    """Find a failure of hook ``name`` with the CLI, then run its printed replay command
    ``runs`` times in fresh processes, each with another PYTHONHASHSEED: the same exit code,
    the same report bytes (timings blanked), and the failure the search printed."""
    found = _cli([spec(name), "--backend", "gloo", "--world-sizes", "2,3,4", "--examples", "20"], 1)
    assert found.returncode == 1, found.stdout + found.stderr
    replay = re.search(r"replay: +(simcluster check .*)", found.stdout)
    assert replay is not None, found.stdout
    args = replay.group(1).split()[2:]
    block = re.compile(r"^FAILED \w+ \[.*?^  replay:", re.M | re.S)
    first_failure = block.search(found.stdout).group(0)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda seed: _cli(args, seed), range(100, 100 + runs)))
    outputs = {re.sub(r"\d+\.\d+s", "", r.stdout) for r in results}
    assert [r.returncode for r in results] == [1] * runs
    assert len(outputs) == 1, outputs  # the same bytes every time (timings blanked)
    assert block.search(outputs.pop()).group(0) == first_failure  # the property, counterexample, schedule


def test_gossip_hook_is_caught_and_its_replay_reproduces() -> None:
    _replay_reproduces("gossip_alias", 3)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 21 CLI processes, 2 at a time: minutes on 2 shared cores
@pytest.mark.parametrize("name", ["gossip_alias", "numpy_noise", "torch_noise", "module_rng_drop", "module_cache"])
def test_replays_of_hooks_using_rngs_and_module_state_reproduce_20_of_20(name: str) -> None:
    _replay_reproduces(name, 20)


def test_ranks_loading_their_copies_at_once_each_get_their_own_complete_copy() -> None:
    # e2e's real DDP runs every rank's setup on its own thread, and each loads the state
    # factory then the hook from its copy of the file. The loads used to share sys.modules
    # unguarded: a rank got another rank's half-executed copy ("module ... has no attribute
    # 'hook'": a FIDELITY BUG reported for a correct hook) or a copy shared with another rank.
    factory, hook = RankLocal(spec("slow_import").replace(":hook", ":factory")), RankLocal(spec("slow_import"))

    def load_rank(_: int) -> tuple[object, object]:
        modules: dict[str, object] = {}
        made = factory.load(modules)
        return made, hook.load(modules)

    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(load_rank, range(4)))
    for made, rank_hook in loaded:
        assert made.__globals__ is rank_hook.__globals__  # one copy per rank: factory and hook share it
    assert len({id(h.__globals__) for _, h in loaded}) == 4  # and no two ranks share one


def test_a_first_import_setting_filters_and_environ_is_not_the_ranks_change() -> None:
    # torch.optim.AdamW's first step imports sympy (7 warnings filters) and inductor
    # (TORCHINDUCTOR_CACHE_DIR) in the process; the audit blamed the rank that stepped
    # first (OverlappedAdamW, an optimizer-in-the-hook) and refused to check the hook.
    sys.modules.pop("lazy_settings_lib", None)
    os.environ.pop("SIMCLUSTER_TEST_LAZY_LIB_DIR", None)
    sys.path.insert(0, str(HOOKS))
    try:
        def rank_fn(rank: int) -> None:
            import lazy_settings_lib  # noqa: F401 - first import on rank 0's turn

        SimCluster(2).run(rank_fn)
        assert os.environ["SIMCLUSTER_TEST_LAZY_LIB_DIR"] == "/tmp/lazy-lib"  # kept, as in a process
    finally:
        sys.path.remove(str(HOOKS))
        os.environ.pop("SIMCLUSTER_TEST_LAZY_LIB_DIR", None)


def test_a_rank_changing_filters_after_an_import_is_still_reported() -> None:
    def rank_fn(rank: int) -> None:
        if rank == 1:
            import json  # noqa: F401 - already imported: no first import on this turn
            warnings.filters.clear()  # the rank's own change: removes the process's filters

    before = list(warnings.filters)
    with pytest.raises(SharedSettingError, match="rank 1 changed warnings.filters"):
        SimCluster(2).run(rank_fn)
    assert warnings.filters == before


def test_a_filter_replaced_in_place_is_reported_to_the_rank_that_replaced_it() -> None:
    """Rank 0 replaces the second filter (the list's length and first filter kept); rank 1
    warns. The audit compared only the length and the first filter: the change went unseen,
    and rank 1's warning, an error under rank 0's filter, failed rank 1 — a process of its
    own never has that filter (an audit of hostile hooks, 2026-12-07)."""
    def rank_fn(rank: int) -> None:
        if rank == 0:
            warnings.filters[1] = ("error", None, UserWarning, None, 0)
            warnings._filters_mutated()  # type: ignore[attr-defined]
        else:
            warnings.warn("rank 1's harmless warning", UserWarning)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.filterwarnings("ignore", message="never matches anything")
        before = list(warnings.filters)
        assert len(before) >= 2
        with pytest.raises(SharedSettingError, match=r"rank 0 changed warnings.filters from \d+ filters to \d+ filters, "
                                                     r"filter 1 now \('error'"):
            SimCluster(2).run(rank_fn)
        assert warnings.filters == before


def test_a_generator_function_a_rank_assigns_is_its_value_in_the_run_and_undone_after() -> None:
    original_seed, original_rand = random.seed, numpy.random.rand

    def mine(*args: object) -> str:
        return "mine"

    def body(rank: int) -> tuple[object, ...]:
        drawn = random.random()  # the rank's own generator: its dispatcher, not the dict's function
        if rank == 0:
            random.seed = mine  # rank code replacing a module function: seen from then on
            del numpy.random.rand
        return drawn, random.seed(), hasattr(numpy.random, "rand"), vars(random)["random"] == random._inst.random

    values = SimCluster(2, seed=3).run(body).values
    assert values[0][0] == random.Random(3).random() and values[1][0] == random.Random(4).random()
    assert [v[1:] for v in values] == [("mine", False, True), ("mine", False, True)]
    assert random.seed is original_seed and numpy.random.rand is original_rand  # put back after the run
    assert type(random) is type(numpy.random) is types.ModuleType  # noqa: E721 - the class itself is the point


def test_each_rank_has_a_process_id_of_its_own_the_same_every_run() -> None:
    """A hook seeding a generator from ``os.getpid()`` (a per-worker idiom) drew the same
    numbers on every simulated rank, so its replicas agreed where real gloo's drifted apart
    (an audit of hostile hooks; ``simcluster e2e`` exit 4). Each rank's pid is its own, the same
    every run (a replay repeats), and no other process's: signalling it signals this one."""
    from simcluster.usercode.rank_state import SIMULATED_PID_BASE

    def rank_fn(rank: int) -> int:
        os.kill(os.getpid(), 0)  # signal 0: "does it exist" — this process
        return os.getpid()

    real = os.getpid()
    first = SimCluster(3, seed=0).run(rank_fn).values
    assert first == [SIMULATED_PID_BASE + r for r in range(3)] == SimCluster(3, seed=5).run(rank_fn).values
    assert os.getpid() == real and os.kill is not None
    with pytest.raises(ProcessLookupError):  # outside a run, the simulated pid is nobody's
        os.kill(SIMULATED_PID_BASE, 0)
