"""Hostile hooks: a check always ends, reports what the hook did, and never passes silently.

Each test runs a tiny hook from ``tests/hostile/hooks.py`` that spins, blocks, exits,
kills its process, raises ``KeyboardInterrupt`` or posts from a thread of its own, and
asserts the exit code, what the report names (hook, rank, line, stack), the time bound
(deadline + a small constant: a stuck example is not re-run) and that nothing is left
behind (no default group, RNGs restored, no simulator thread, no child process).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hostile.hooks import ORPHAN_PROCESS, SESSION_PROCESS, STARTED_PROCESS, line_of
from processes import children, ctrl_c_as_from_a_terminal, in_session
from simcluster import SimCluster
from simcluster.checking.check import check_hook
from simcluster.errors import DeadlockError, ForeignThreadError, StuckError, ThreadedRankCodeError

HERE = Path(__file__).parent
HERE_SOURCE = Path(__file__).read_text().splitlines()
HOOKS = HERE / "hostile" / "hooks.py"
SLACK = 12.0  # seconds allowed beyond the deadline: fork, report, a loaded 2-core CI machine


def target(name: str) -> str:
    return f"{HOOKS}:{name}"


def simcluster_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("simcluster-")]


def check(name: str, **options):
    options = {"world_sizes": (2,), "examples": 5, "database": None, **options}
    before = children()
    start = time.monotonic()
    report = check_hook(target(name), **options)
    elapsed = time.monotonic() - start
    assert children() == before, "a supervised child survived the check"
    return report, elapsed


# ---------------------------------------------------------------- exits
@pytest.mark.parametrize("name, code", [("sys_exit_zero", "sys.exit(0)"), ("sys_exit_one", "sys.exit(1)"),
                                         ("os_exit_three", "os._exit(3)")])
def test_a_hook_that_exits_is_a_liveness_failure(name, code):
    report, _ = check(name)
    assert not report.passed
    assert {(f.property, f.backend) for f in report.failures} == {("liveness", "gloo"), ("liveness", "nccl")}
    message = report.failures[0].message
    assert code in message and "rank 0" in message and f"in {name}" in message


@pytest.mark.parametrize("name, line", [("os_exit_caught", "os._exit(1)"), ("os_exit_in_del", "os._exit(0)"),
                                         ("os_exit_in_joined_thread", None)])
def test_an_os_exit_the_code_caught_is_still_a_liveness_failure(name, line):
    """Under supervision os._exit raises in place of ending the process; code that caught
    that (``except Exception``, a ``__del__``, a thread) went on, and the check passed. On a
    real cluster the process had ended (an audit of hostile hooks, 2026-12-07)."""
    report, _ = check(name)
    assert not report.passed
    assert {f.property for f in report.failures} == {"liveness"}, report.format()
    message = report.failures[0].message
    assert "HookExited: os._exit(" in message and "this rank's process ends here" in message, message
    if line is not None:
        assert f"in {name}: {line}" in message or line in message, message


@pytest.mark.parametrize("name", ["forks_a_child_that_exits", "forks_a_child_that_raises", "joins_a_multiprocessing_fork"])
def test_a_hook_that_forks_ends_and_passes(name):
    """The fork inherited the os._exit that raises, or fell back into the engine, and carried
    the search on — refreshing the deadline its parent watches — for ever (an audit of hostile
    hooks, 2026-12-07: 300 s timeouts). A fork of a rank now leaves once its code is back in
    the engine, and os._exit ends it."""
    report, elapsed = check(name, examples=3)
    assert report.passed, report.format()
    assert elapsed < 60


def test_a_hook_killing_its_parent_kills_its_simulated_rank_not_the_checking_process():
    """``os.kill(os.getppid(), SIGKILL)`` killed the checking process itself — no report, exit
    137 (an audit of hostile hooks, 2026-12-07). A rank's parent is now a simulated launcher,
    and a signal to it is a signal to the process the ranks run in: on a cluster the job ends."""
    from simcluster.usercode.rank_state import SIMULATED_PARENT_PID

    parents = SimCluster(2).run(lambda rank: os.getppid()).values
    assert parents == [SIMULATED_PARENT_PID] * 2 and os.getppid() != SIMULATED_PARENT_PID
    report, _ = check("kills_its_parent", examples=2, backends=("gloo",))
    failure = report.failures[0]
    assert failure.property == "liveness" and "killed by SIGKILL" in failure.message, failure.message
    assert "rank 0, DDP step 0, bucket 0" in failure.message


def test_a_hook_that_stops_itself_is_said_to_have_stopped_with_where_it_stopped():
    """``os.kill(os.getpid(), SIGSTOP)``: a stopped process answers no request for its stack, so
    the deadline's report had none, and called it "spinning or blocked". It is now continued to
    answer — after where it was is read, as it runs on a moment — and said to be stopped."""
    report, _ = check("stops_itself", deadline=1.0, examples=2, backends=("gloo",))
    message = report.failures[0].message
    assert "did not return within 1 s (its process was stopped by a signal (SIGSTOP, SIGTSTP, …)" in message, message
    assert "stuck at rank 0, DDP step 0, bucket 0" in message and "in stops_itself (tests/hostile/hooks.py)" in message
    assert "os.kill(os.getpid(), 19)" in message


def test_a_stuck_hook_that_ignores_the_request_for_its_stack_is_said_to():
    """The supervisor asks a stuck child for its stack with a signal; a hook that ignored it got
    a report with no stack and no word why."""
    report, _ = check("ignores_the_stack_request_then_spins", deadline=1.0, examples=2, backends=("gloo",))
    message = report.failures[0].message
    assert "did not return within 1 s" in message and "stuck at rank 0, DDP step 0, bucket 0" in message
    assert "\n  no stack: its process did not answer the request for one (signal SIGRTMAX-3" in message, message


def test_the_request_for_a_stack_does_not_run_a_preemption_handler_of_the_checked_code():
    """The supervisor asked for a stuck child's stack with SIGUSR1, the signal SLURM sends before
    a job's time limit: a hook with a preemption handler that exits on it was reported as
    calling sys.exit(0) in that handler, not as stuck. The request is now a real-time signal."""
    report, _ = check("preempted_on_sigusr1_then_spins", deadline=1.0, examples=2, backends=("gloo",))
    message = report.failures[0].message
    assert "did not return within 1 s" in message and "sys.exit" not in message, message
    assert "in preempted_on_sigusr1_then_spins (tests/hostile/hooks.py)" in message, message
    stack = message.partition("stack sampled when it was stopped (outermost call first):\n")[2]
    assert " in preempted_on_sigusr1_then_spins\n" in stack, message  # the loop's line varies: either of its two


def _processes_running(argv: list[str]) -> list[int]:
    """The ids of the processes on this machine whose command line is ``argv``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().split(b"\0")[:-1] == [a.encode() for a in argv]:
                found.append(int(entry.name))
        except OSError:  # ended meanwhile
            continue
    return found


def test_processes_a_hook_starts_end_with_its_example():
    """A hook starting a process at every call (a ``subprocess.Popen``) left them all running
    after the check: 138 for three examples. The supervised child leads a process group,
    which they inherit; what is left of it is killed before the child is reaped."""
    assert _processes_running(STARTED_PROCESS) == []
    report, _ = check("starts_a_process_each_call", examples=3)
    assert report.passed, report.format()
    left = _processes_running(STARTED_PROCESS)
    for pid in left:  # the old behaviour: do not leave them to the next test run either
        os.kill(pid, signal.SIGKILL)
    assert left == []


def _ended(argv: list[str]) -> list[int]:
    """The processes running ``argv``, after killing them (none is left to the next test)."""
    left = _processes_running(argv)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.parametrize("name, argv", [("starts_a_session_each_call", SESSION_PROCESS),
                                        ("leaves_an_orphan_each_call", ORPHAN_PROCESS)])
def test_processes_a_hook_starts_in_a_session_of_their_own_end_with_its_child(name, argv):
    """A process started with ``start_new_session=True``, or orphaned by a shell that put it in
    a session of its own, leaves the child's process group, so killing the group missed it:
    three examples left dozens running. The supervised child is a subreaper (orphans below it
    become its children) and ends every process below it before it exits."""
    assert _processes_running(argv) == []
    report, _ = check(name, examples=3, backends=("gloo",))
    assert report.passed, report.format()
    assert _ended(argv) == []


def test_a_process_in_a_session_of_its_own_ends_with_a_child_killed_at_its_deadline():
    """The parent stops the stuck child, ends every process below it, then kills it."""
    assert _processes_running(SESSION_PROCESS) == []
    report, _ = check("starts_a_session_then_spins", deadline=1.0, examples=2, backends=("gloo",))
    assert [f.property for f in report.failures] == ["liveness"], report.format()
    assert _ended(SESSION_PROCESS) == []


def test_a_killed_process_is_a_liveness_failure_with_its_position():
    report, _ = check("kills_itself")
    failure = report.failures[0]
    assert failure.property == "liveness" and "killed by SIGKILL" in failure.message
    assert "rank 0, DDP step 0, bucket 0" in failure.message
    assert "--replay sc1." in failure.replay


def test_a_process_killed_from_a_callback_names_the_rank_whose_code_ran():
    """A hook whose rank 0 callback SIGKILLs the process (the ULFM fault-injection hook from the
    wild, round 8): the report placed it at "rank 1 … (the last hook call that started)" — the
    last hook call announced — and never named rank 0, whose code ran. The supervisor now also
    keeps the rank whose code runs (every hand-over between ranks) and names it."""
    report, _ = check("rank0_callback_kills_process", backends=("gloo",))
    failure = report.failures[0]
    assert failure.property == "liveness" and "killed by SIGKILL" in failure.message
    assert "rank 1, DDP step 0, bucket 0 (the last hook call that started); rank 0's code was running" in (
        failure.message), failure.message


# ---------------------------------------------------------------- stuck code
# A spinning loop may be sampled at either of its lines (the loop test or its body).
SPIN_LINES = ("while True:", "pass")


@pytest.mark.parametrize("name, lines", [("spins", SPIN_LINES), ("sleeps", ("time.sleep(10_000)",)),
                                          ("waits_forever", ("threading.Event().wait()",)),
                                          ("spins_after_wait", SPIN_LINES)])
def test_stuck_code_is_reported_within_the_deadline(name, lines):
    report, elapsed = check(name, deadline=2.0, backends=("gloo",))
    assert elapsed < 2.0 + SLACK, f"took {elapsed:.1f}s: a stuck example was re-run"
    [failure] = report.failures
    assert failure.property == "liveness" and failure.backend == "gloo"
    assert "did not return within 2 s" in failure.message
    assert f"in {name}" in failure.message
    assert any(f"\n        {line}" in failure.message for line in lines), failure.message
    assert "rank " in failure.message and "DDP step 0" in failure.message
    assert report.examples == 1  # the stuck example is reported as it is, not shrunk by re-running it


def test_a_hook_that_replaces_the_clock_is_still_stopped_at_the_deadline():
    """The example's start was written, and read, through ``time.monotonic``: a hook that
    pushed that clock ahead in one example and spun in the next was never stopped (an audit
    of hostile hooks, 2026-12-07). The deadline's clock is now simcluster's own reference."""
    report, elapsed = check("pushes_the_clock_ahead_then_spins", deadline=2.0, backends=("gloo",), world_sizes=(1,))
    assert elapsed < 2.0 + SLACK, f"took {elapsed:.1f}s"
    [failure] = report.failures
    assert failure.property == "liveness" and "did not return within 2 s" in failure.message, failure.message


def test_a_slow_hook_under_the_deadline_passes():
    report, _ = check("slow_but_fine", deadline=20.0, examples=2, backends=("gloo",), world_sizes=(2,), steps=1)
    assert report.passed, report.format()


def test_the_stuck_replay_reproduces_as_printed():
    report, _ = check("spins", deadline=1.0, backends=("nccl",))
    replay = report.failures[0].replay
    token = replay.split("--replay ")[1]
    again = check_hook(target("spins"), deadline=1.0, replay=token, database=None)
    # the verdict, the example and where (rank, step, bucket, function) are the same; only the
    # sampled stack's line may differ for a spinning loop
    first = report.failures[0]
    [second] = again.failures
    assert (second.property, second.replay, second.message.splitlines()[0]) == \
        (first.property, first.replay, first.message.splitlines()[0])
    assert "in spins (tests/hostile/hooks.py)" in first.message.splitlines()[0]


# ---------------------------------------------------------------- stop means stop
def test_keyboard_interrupt_from_a_hook_stops_the_whole_check():
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as info:
        check_hook(target("raises_keyboard_interrupt"), world_sizes=(4,), examples=50, database=None)
    assert time.monotonic() - start < SLACK
    assert any("raises_keyboard_interrupt" in note for note in info.value.__notes__)


@pytest.mark.parametrize("name", ["leaves_a_raising_tracer", "leaves_a_raising_profiler",
                                  "leaves_a_tracer_raising_in_the_engine"])
def test_a_trace_or_profile_function_left_by_the_hook_is_no_internal_error(name):
    """Left behind, it ran in simcluster's engine and judge and raised there: "internal error",
    tracebacks, exit 3 (an audit of hostile hooks, 2026-12-07). The run now puts it back when it
    ends and says what it was; one raising inside the engine's step is the code's exception."""
    result = run_cli(target(name), "--examples", "5", "--world-sizes", "2")
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    if name == "leaves_a_raising_tracer":  # left behind: it was the run's, not one rank's
        assert result.returncode == 3, result.stderr
        assert "not modelled by the simulator: a rank changed sys.gettrace(), sys.getprofile()" in result.stderr
        assert f"to ({name}.<locals>.tracer, None) during the run" in result.stderr, result.stderr
    elif name == "leaves_a_raising_profiler":  # it raised in rank 1's hook, 500 events on: that rank's failure
        assert result.returncode == 1, result.stderr
        assert "RuntimeError: the profiler says stop" in result.stdout
    else:  # it raised inside the engine's step: the code's exception, where and why told
        assert result.returncode == 1, result.stderr
        assert "RuntimeError: the tracer stops the engine" in result.stdout
        assert "raised by the code under test while simcluster's engine ran" in result.stdout
        assert 'in tracer: raise RuntimeError("the tracer stops the engine")' in result.stdout


def test_a_death_that_the_example_alone_does_not_repeat_says_so():
    """A hook that armed signal.alarm in one example was killed by SIGALRM in a later one, and
    the report offered a replay command that passed (an audit of hostile hooks, 2026-12-07).
    The example that died is run once more, alone in a fresh process; one that always dies
    gets no such note."""
    flaky = "run once more, alone in a fresh process, the same example did not end its process"
    report, _ = check("dies_at_its_processes_twelfth_call", backends=("gloo",), examples=10)
    [death] = [f for f in report.failures if "killed by SIGKILL" in f.message]
    assert flaky in death.message, death.message
    report, _ = check("kills_itself", backends=("gloo",))
    assert report.failures and all(flaky not in f.message for f in report.failures), report.format()


def test_a_death_between_examples_names_the_example_that_returned_and_replays_it():
    """A hook that closed every file descriptor let its example return, then the process died
    unable to report: the report said 'world size 0 … before the first hook call' and its replay
    dropped every option and the token (an audit of hostile hooks). The example that returned
    last is the one to replay, and where it was is said."""
    report, _ = check("closes_every_file_descriptor", backends=("gloo",), world_sizes=(1, 2))
    [death] = [f for f in report.failures if f.property == "liveness"]
    assert "between two examples, after one had returned (its last hook call: rank" in death.message, death.message
    assert death.world_size in (1, 2) and " --replay sc1." in death.replay and "--world-sizes" in death.replay
    assert "may not repeat" not in death.message  # run alone, the example ends its process again
    assert "world size 0" not in death.format()


def test_a_hook_that_closes_its_stdout_is_told_and_checked_like_a_real_rank():
    """explain (and check's reporting runs, which tell each rank's lines) read fd 1's offset
    at every hand-over and failed with 'OSError: [Errno 9] Bad file descriptor', blamed on the
    hook (an audit of hostile hooks). A real rank that closes its stdout and prints nothing
    after is fine."""
    result = subprocess.run([sys.executable, "-m", "simcluster", "explain", target("closes_its_stdout")],
                            capture_output=True, text=True, timeout=240, cwd=HERE.parent)
    assert result.returncode == 0 and "Bad file descriptor" not in result.stdout + result.stderr, result.stdout


def test_an_exception_whose_str_raises_is_reported_as_itself():
    """It was reported as the ValueError its ``__str__`` raised, at the ``__str__`` line, not as
    the hook's exception at the hook's line (an audit of hostile hooks)."""
    report, _ = check("raises_an_unprintable_error", backends=("gloo",))
    [failure] = report.failures
    assert failure.error_type == "Unprintable", failure.format()
    assert "Unprintable: <its str() raised ValueError: no words for it>" in failure.message
    assert "in raises_an_unprintable_error: raise Unprintable()" in str(failure.frames[-1])


def test_exceptions_python_ignores_are_printed_ten_times_then_counted():
    """A hook that left a raising gc callback behind wrote millions of "Exception ignored in"
    lines to the terminal (an audit of hostile hooks, 2026-12-07: 3.1 M with gc.set_threshold(1))."""
    result = run_cli(target("leaves_a_raising_gc_callback"), "--examples", "3", "--world-sizes", "2",
                     "--backend", "gloo")
    assert result.returncode == 1, result.stderr
    assert (result.stdout + result.stderr).count("Exception ignored") <= 10
    assert re.search(r"simcluster: the checked code raised \d+ exceptions Python ignored \(in gc callbacks, "
                     r"__del__ methods or weakref callbacks\); only the first 10 were printed", result.stderr), \
        result.stderr


def test_a_hook_that_sends_its_own_process_sigint_stops_the_check_as_a_raise_does():
    """The supervised child ignored SIGINT, so a hook doing ``os.kill(os.getpid(), SIGINT)``
    went on and passed, where a real rank's process ends (an audit of hostile hooks,
    2026-12-07: exit 0)."""
    with pytest.raises(KeyboardInterrupt) as info:
        check("sends_itself_sigint")
    assert any("os.kill(os.getpid(), signal.SIGINT)" in note for note in info.value.__notes__), info.value.__notes__


def test_keyboard_interrupt_in_process_needs_one_raise_and_cleans_up():
    cluster = SimCluster(4)
    rng = torch.get_rng_state()
    with pytest.raises(KeyboardInterrupt):
        cluster.run_hook(HOOK_MODULE.raises_keyboard_interrupt, [torch.ones(2)] * 4)
    assert_clean(rng)


# ---------------------------------------------------------------- threads
def test_a_deadlock_after_a_rank_started_a_thread_is_no_verdict_told_the_same_every_time():
    """The thread's all_reduce is rejected in it (ForeignThreadError), so the returned future
    never completes and the ranks deadlock; whether the thread would have completed it on a
    real cluster is not known, so the run gives no verdict (an ``UnsupportedError``: exit 3),
    worded from what rank code did (not from the thread's racing call): the same each time."""
    seen = []
    for _ in range(3):
        with pytest.raises(ThreadedRankCodeError) as info:
            SimCluster(2).run_hook(HOOK_MODULE.posts_from_thread, [torch.ones(2)] * 2)
        seen.append(str(info.value))
        assert isinstance(info.value.__cause__, DeadlockError)
    assert len(set(seen)) == 1
    assert ("the ranks deadlocked after rank 0's code started a thread running posts_from_thread.<locals>.worker "
            "(started at tests/hostile/hooks.py:") in seen[0]
    assert "threading.Thread(target=worker, daemon=True).start()" in seen[0]


def test_a_rejected_call_prints_no_traceback_from_the_thread(capfd: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The rejection (ForeignThreadError) escaped the hook's thread, and Python's
    threading.excepthook printed its traceback to stderr whenever the thread got there —
    after the example's capture, in the middle of the report, on some runs and not others
    (round 22 of hooks from the wild). It is reported with the run, and the thread ends quietly."""
    escaped: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))  # pytest's, else
    for _ in range(3):
        before = set(threading.enumerate())
        with pytest.raises(ThreadedRankCodeError):
            SimCluster(2).run_hook(HOOK_MODULE.posts_from_thread, [torch.ones(2)] * 2)
        for thread in set(threading.enumerate()) - before:
            thread.join(timeout=10)
    out, err = capfd.readouterr()
    assert escaped == [] and "Traceback" not in err, (escaped, err)


def test_a_deadlock_without_threads_stays_the_hooks_deadlock():
    with pytest.raises(DeadlockError):
        SimCluster(2).run_hook(_deadlocking_hook, [torch.ones(2)] * 2)


def test_the_foreign_thread_gets_a_clear_error_and_the_run_gives_no_verdict():
    """The hook joins its thread, so the rejected call is always seen: the run's story names
    the rank, the thread and the user line of the call (a fallback path ran instead of the
    thread's all_reduce, which a real cluster would have run)."""
    HOOK_MODULE.THREAD_ERRORS.clear()
    with pytest.raises(ThreadedRankCodeError) as info:
        SimCluster(2).run_hook(HOOK_MODULE.posts_from_joined_thread, [torch.ones(2), 3 * torch.ones(2)])
    errors = HOOK_MODULE.THREAD_ERRORS
    assert len(errors) == 2 and all(isinstance(e, ForeignThreadError) for e in errors)
    assert "all_reduce on WORLD" in str(errors[0]) and "posts_from_joined_thread.<locals>.worker" in str(errors[0])
    assert str(info.value).startswith(
        "rank 0's code started a thread running posts_from_joined_thread.<locals>.worker (started at "
        "tests/hostile/hooks.py:"), str(info.value)
    assert re.search(r"which called all_reduce on WORLD \(rank 0\) at tests/hostile/hooks\.py:\d+ in worker: "
                     r"dist\.all_reduce\(bucket\.buffer\(\), async_op=True\)", str(info.value))
    assert "(1 more such call(s))" in str(info.value)


def test_a_thread_that_only_computes_is_no_finding():
    run = SimCluster(2).run_hook(HOOK_MODULE.compresses_on_a_pool_thread, [torch.ones(2), 3 * torch.ones(2)])
    assert [o.tolist() for o in run.outputs] == [[2.0, 2.0], [2.0, 2.0]]


def test_cli_a_hook_whose_pool_thread_all_reduces_is_not_modelled_exit_3():
    """A hook from the wild's pattern: on a real cluster correct; the simulation said
    'FAILED liveness: deadlock' (exit 1), a false alarm."""
    result = run_cli(target("averages_on_a_pool_thread"), "--examples", "5", "--world-sizes", "2",
                     "--backend", "gloo")
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "not modelled by the simulator: the ranks deadlocked after rank 0's code started a thread" in result.stderr
    assert "_pool().submit(work)" in result.stderr


# ---------------------------------------------------------------- clean state after any ending
def assert_clean(rng: torch.Tensor) -> None:
    assert not dist.is_initialized()
    assert torch.equal(torch.get_rng_state(), rng)
    deadline = time.monotonic() + 5
    while simcluster_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert simcluster_threads() == []


def _ok_hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _raising_hook(state, bucket):
    raise ValueError("boom")


def _deadlocking_hook(state, bucket):
    if dist.get_rank() == 0:
        dist.all_reduce(bucket.buffer(), async_op=True).wait()
    return _ok_hook(state, bucket)


def _blocks_in_c_after_wait(state, bucket):
    dist.all_reduce(bucket.buffer(), async_op=True).wait()
    threading.Event().wait(3)
    return _ok_hook(state, bucket)


@pytest.mark.parametrize("hook, error", [(_ok_hook, None), (_raising_hook, ValueError),
                                          (_deadlocking_hook, DeadlockError)])
def test_state_is_clean_after_each_ending(hook, error):
    rng = torch.get_rng_state()
    cluster = SimCluster(3)
    if error is None:
        cluster.run_hook(hook, [torch.ones(2)] * 3)
    else:
        with pytest.raises(error):
            cluster.run_hook(hook, [torch.ones(2)] * 3)
    assert_clean(rng)


def test_state_is_clean_after_a_stuck_run_in_process():
    rng = torch.get_rng_state()
    before = set(threading.enumerate())
    with pytest.raises(StuckError):
        SimCluster(2, stuck_timeout=1).run_hook(_blocks_in_c_after_wait, [torch.ones(2)] * 2)
    assert not dist.is_initialized()
    assert torch.equal(torch.get_rng_state(), rng)
    # the thread left blocked in C (by design: nothing can fail it) ends once its wait does;
    # waited for here, so no later test in this process finds it (test_real_ddp's thread checks did)
    left = [t for t in threading.enumerate() if t not in before and t.name.startswith("simcluster")]
    for thread in left:
        thread.join(timeout=10)
    assert not [t.name for t in left if t.is_alive()]


def test_state_is_clean_after_a_killed_example():
    rng = torch.get_rng_state()
    check("kills_itself", backends=("gloo",))
    assert_clean(rng)


# ---------------------------------------------------------------- the command line
def run_cli(*args: str, timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simcluster", "check", "--quiet", "--no-database", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=HERE.parent, **kwargs)


def test_cli_sys_exit_fails_and_other_targets_are_still_reported(tmp_path):
    out = tmp_path / "report.json"
    result = run_cli("simcluster.hooks.buggy:forgot_division", target("sys_exit_zero"), "--examples", "5",
                     "--world-sizes", "2", "--json", str(out))
    assert result.returncode == 1, result.stderr
    assert "forgot_division" in result.stdout and "FAIL:averages" in result.stdout
    assert "sys_exit_zero" in result.stdout and "FAIL:liveness" in result.stdout
    reports = json.loads(out.read_text())
    assert [r["passed"] for r in reports] == [False, False]


def test_a_thread_post_that_does_not_repeat_is_still_the_one_not_modelled_line():
    """A hook whose thread posts a collective later (0.3 s) was rejected in one run of an
    example and not in Hypothesis' re-run: its FlakyFailure was reported as simcluster's
    internal error, 170 lines of traceback (an audit of hostile hooks). Here the first call in
    the process posts from a thread and no later one does — the same flakiness, on purpose."""
    with pytest.raises(ThreadedRankCodeError, match="started a thread running thread_posts_on_the_first_call_only"):
        check("thread_posts_on_the_first_call_only", backends=("gloo",))


def test_pytest_skip_in_a_hook_is_its_failure_outside_a_test_and_a_stop_request_inside_one():
    """``simcluster check`` of a hook calling ``pytest.skip()`` printed no report, only a
    traceback (exit 1; an audit of hostile hooks): pytest's outcome exceptions were always
    taken as a request to stop the program. They are one only while pytest runs a test."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    result = run_cli(target("calls_pytest_skip"), "--examples", "5", "--world-sizes", "1", "--backend", "gloo", env=env)
    assert result.returncode == 1, result.stderr
    assert "FAILED liveness [gloo, world size 1]" in result.stdout and "Skipped: this hook decided to skip" in result.stdout
    assert "replay:" in result.stdout and "Traceback" not in result.stderr, result.stderr
    with pytest.raises(pytest.skip.Exception, match="this hook decided to skip"):  # inside a test: the test's own
        SimCluster(2).run_hook(target("calls_pytest_skip"), [torch.ones(2)] * 2)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_what_one_targets_import_does_to_its_process_reaches_no_other_row(tmp_path, jobs):
    """One TARGET's module replaces torch.distributed.all_reduce at import; a correct hook
    checked in the same command failed ``averages`` — in either order, with any ``--jobs``
    (an audit of hostile hooks, 2026-12-07). Each row is now checked in a process of its own
    that imports its TARGET alone, as separate programs would."""
    leaky = f"{HERE / 'hostile' / 'import_replaces_all_reduce.py'}:hook"
    for first, second in ((leaky, "simcluster.hooks.reference:mean_allreduce_hook"),
                          ("simcluster.hooks.reference:mean_allreduce_hook", leaky)):
        out = tmp_path / "report.json"
        result = run_cli(first, second, "--examples", "5", "--world-sizes", "2", "--backend", "gloo", "--jobs", jobs,
                         "--json", str(out))
        assert result.returncode == 1, result.stderr
        passed = {r["target"].rsplit(":", 1)[0].rsplit("/", 1)[-1]: r["passed"] for r in json.loads(out.read_text())}
        assert passed == {"import_replaces_all_reduce.py": False, "simcluster.hooks.reference": True}, result.stdout


def test_the_cli_runs_with_a_fixed_string_hash_seed(tmp_path):
    """Python seeds its string hashes at start-up from OS entropy: a hook iterating a set of
    strings gave another verdict, and its replay another outcome, on each invocation (an
    audit of hostile hooks, 2026-12-07). The command runs itself again with PYTHONHASHSEED=0
    when it is not set; a seed the user sets is kept."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    said = []
    for seed in (None, None, "7"):
        out = tmp_path / "report.json"
        result = run_cli(target("says_its_string_order"), "--examples", "1", "--world-sizes", "1", "--backend", "gloo",
                         "--json", str(out), env=env if seed is None else {**env, "PYTHONHASHSEED": seed})
        assert result.returncode == 1, result.stderr
        [failure] = json.loads(out.read_text())[0]["failures"]
        said.append(re.search(r"PYTHONHASHSEED=(\S+) order=(\[[^]]*\])", failure["message"]).groups())
    assert said[0] == said[1] and said[0][0] == "0", said
    assert said[2][0] == "7"


def test_the_report_on_stdout_is_the_same_bytes_on_every_run_of_a_command():
    """The table's wall-clock time column made two runs of one replay of a deterministic hook
    differ (an audit of hostile hooks, 2026-12-07): the table counts examples instead, and
    the times go to stderr."""
    command = ("simcluster.hooks.buggy:forgot_division", "--examples", "5", "--world-sizes", "2")
    first, second = run_cli(*command), run_cli(*command)
    assert first.returncode == second.returncode == 1, first.stderr
    assert first.stdout == second.stdout and "examples" in first.stdout.splitlines()[0], first.stdout
    loud = subprocess.run([sys.executable, "-m", "simcluster", "check", "--no-database", *command],
                          capture_output=True, text=True, timeout=240, cwd=HERE.parent)
    assert re.search(r"simcluster: rows took \d+\.\d s \(slowest: simcluster.hooks.buggy:forgot_division "
                     r"\d+\.\d s\)", loud.stderr), loud.stderr


def test_a_base_exception_of_the_hooks_own_is_its_failure_and_its_keyboard_interrupt_stops_the_check():
    """A hook raising a BaseException subclass of its own (defined in its module, so its class
    cannot be unpickled by the parent) was an internal error with a traceback, exit 3; a
    KeyboardInterrupt subclass of its own too, where Ctrl-C's 130 is due (an audit of hostile
    hooks, 2026-12-07)."""
    report, _ = check("raises_a_base_exception_of_its_own", backends=("gloo",))
    assert {f.property for f in report.failures} == {"liveness"}, report.format()
    assert "BaseOfItsOwn: the hook's own BaseException" in report.failures[0].message, report.failures[0].message
    result = run_cli(target("raises_a_keyboard_interrupt_of_its_own"), "--examples", "2", "--world-sizes", "1")
    assert result.returncode == 130, result.stderr
    assert "raised as" in result.stderr and "InterruptOfItsOwn" in result.stderr and "Traceback" not in result.stderr


def _dump_from_depth(depth: int, path: Path) -> None:
    if depth:
        _dump_from_depth(depth - 1, path)  # recurses
        return
    with open(path, "w") as out:
        # the stack sample a stuck example's supervisor takes (of this thread only: under xdist
        # execnet's threads are in the dump, and they are no part of simcluster or the checked code)
        faulthandler.dump_traceback(out, all_threads=False)  # sampled here


def _began_the_recursion(path: Path, depth: int) -> None:
    _dump_from_depth(depth, path)  # the hook's own line


@pytest.mark.parametrize("depth", [20, 150])
def test_a_sampled_stack_shows_a_recursion_once_and_says_when_the_sample_is_cut(depth, tmp_path):
    """A hook stuck deep in a recursion: its sampled stack was eight copies of the recursing line
    (faulthandler keeps the innermost 100 frames, so the hook's own line was not in it either).
    The recursing line is now shown once, said to be a recursion, under the line that began it —
    or, when faulthandler cut the stack, a line saying the outer calls are not in the sample."""
    from simcluster.checking.supervisor import format_stack

    _began_the_recursion(tmp_path / "dump", depth)
    shown = format_stack((tmp_path / "dump").read_text()).splitlines()
    recursing = next(n for n, line in enumerate(HERE_SOURCE, 1) if "# recurses" in line)
    began = next(n for n, line in enumerate(HERE_SOURCE, 1) if "# the hook's own line" in line)
    sampled = next(n for n, line in enumerate(HERE_SOURCE, 1) if "# sampled here" in line)
    here = "tests/test_hostile.py" if Path.cwd() == HERE.parent else str(HERE / "test_hostile.py")
    assert [line for line in shown if " in _dump_from_depth" in line] == [
        f"    {here}:{recursing} in _dump_from_depth  [the same line again and again: a recursion]",
        f"    {here}:{sampled} in _dump_from_depth"]
    if depth < 100:
        assert f"    {here}:{began} in _began_the_recursion" in shown and "… (outer calls" not in shown[0]
    else:
        assert shown[0] == "    … (outer calls not shown: the stack is deeper than the 100 frames a sample holds)"
        assert not any("_began_the_recursion" in line for line in shown)


def _dump_from_ping(depth: int, path: Path) -> None:
    if depth:
        _dump_from_pong(depth - 1, path)  # ping calls pong
        return
    _dump_from_depth(0, path)


def _dump_from_pong(depth: int, path: Path) -> None:
    _dump_from_ping(depth, path)  # pong calls ping


def test_a_sampled_stack_shows_a_mutual_recursion_once(tmp_path):
    """A hook stuck at the bottom of two functions calling each other: its sampled stack was
    eight lines of the pair, without the line that began it. The pair is now shown once."""
    from simcluster.checking.supervisor import format_stack

    _dump_from_ping(10, tmp_path / "dump")  # began here
    shown = format_stack((tmp_path / "dump").read_text()).splitlines()
    lines = {mark: next(n for n, line in enumerate(HERE_SOURCE, 1) if mark in line)
             for mark in ("# ping calls pong", "# pong calls ping", "# began here")}
    here = "tests/test_hostile.py" if Path.cwd() == HERE.parent else str(HERE / "test_hostile.py")
    assert [line for line in shown if line.startswith("    ") and not line.startswith("        ")][:3] == [
        f"    {here}:{lines['# began here']} in test_a_sampled_stack_shows_a_mutual_recursion_once",
        f"    {here}:{lines['# ping calls pong']} in _dump_from_ping",
        f"    {here}:{lines['# pong calls ping']} in _dump_from_pong  [the last 2 lines again and again: a recursion]"]


def test_cli_stuck_hook_exit_1_with_stack(tmp_path):
    out = tmp_path / "report.json"
    start = time.monotonic()
    result = run_cli(target("sleeps"), "--deadline", "1", "--backend", "gloo", "--json", str(out))
    assert time.monotonic() - start < 1 + SLACK + 10  # + the interpreter's start-up
    assert result.returncode == 1, result.stderr
    assert "time.sleep(10_000)" in result.stdout and "did not return within 1 s" in result.stdout
    assert json.loads(out.read_text())[0]["failures"][0]["property"] == "liveness"


def _ctrl_c_once_the_hook_runs(spec: str, started: Path) -> subprocess.Popen:
    """Start ``simcluster check SPEC`` as from a terminal, wait until its hook says it runs (a
    file in ``started``: a fixed 8 s sleep left a thin margin under load), then press Ctrl-C
    (SIGINT to the whole foreground group, as the terminal sends it)."""
    proc = subprocess.Popen([sys.executable, "-m", "simcluster", "check", "--quiet", "--no-database", spec,
                             "--backend", "gloo"], cwd=HERE.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, "SIMCLUSTER_TEST_STARTED": str(started)},
                            preexec_fn=ctrl_c_as_from_a_terminal)
    limit = time.monotonic() + 120
    while time.monotonic() < limit and not any(started.iterdir()):
        time.sleep(0.1)
    assert any(started.iterdir())
    os.killpg(proc.pid, signal.SIGINT)
    return proc


def test_cli_ctrl_c_ends_the_run_at_once_and_leaves_no_process(tmp_path):
    proc = _ctrl_c_once_the_hook_runs(target("spins_announced"), tmp_path)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert f"{target('spins_announced')} was being checked" in err  # which row, then where its code was
    assert "the checked code was here when this arrived:" in err and re.search(
        r"hooks\.py:\d+ in spins_announced", err), err
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # no process of the run's group is left
    assert not in_session(proc.pid)  # nor the supervised child, in a group of its own


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_cli_sigterm_ends_the_run_with_143_and_says_where_it_was(tmp_path, jobs):
    """SIGTERM (a CI job's time limit) ended the command at once, status 143 and not a word
    of what was being checked (an audit of hostile hooks, 2026-12-07: a hook that sent its
    parent SIGTERM). Now it stops as Ctrl-C does: where the checked code was, no process left."""
    rows = [target("spins_announced")] + ([target("spins_announced"), target("sleeps_announced")] if jobs == "2" else [])
    proc = subprocess.Popen([sys.executable, "-m", "simcluster", "check", "--quiet", "--no-database", *rows,
                             "--backend", "gloo", "--jobs", jobs], cwd=HERE.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "SIMCLUSTER_TEST_STARTED": str(tmp_path)})
    limit = time.monotonic() + 120
    while time.monotonic() < limit and not any(tmp_path.iterdir()):
        time.sleep(0.1)
    assert any(tmp_path.iterdir())
    proc.send_signal(signal.SIGTERM)  # to the command only, as `timeout` does
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err
    assert "simcluster: terminated (SIGTERM)" in err and "was being checked" in err, err
    time.sleep(0.5)
    assert not in_session(proc.pid)  # no process of the run is left (the supervised child has a group of its own)


SIGINT_WHILE_IMPORTING = """
import os, signal, sys

MODULE = sys.argv.pop(1)


class SigintWhileImporting:  # Ctrl-C pressed just as MODULE starts importing
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None


sys.meta_path.insert(0, SigintWhileImporting())
from simcluster.cli import main
sys.exit(main())
"""


def test_ctrl_c_while_torch_imports_is_not_swallowed(tmp_path):
    """torch's C start-up imports numpy and goes on without it when that import raises —
    KeyboardInterrupt included. Pressed then (~0.5 s after start), Ctrl-C was lost: the check
    of a spinning hook ran to its deadline and exited 1. The command line now holds Ctrl-C
    during those imports and raises it right after them."""
    driver = tmp_path / "driver.py"
    driver.write_text(SIGINT_WHILE_IMPORTING)
    result = subprocess.run([sys.executable, str(driver), "numpy._core._multiarray_umath", "check", "--quiet",
                             "--no-database", target("spins"), "--backend", "gloo", "--deadline", "30"],
                            cwd=HERE.parent, capture_output=True, text=True, timeout=120,
                            preexec_fn=ctrl_c_as_from_a_terminal)
    assert result.returncode == 130, result.stderr
    assert result.stderr.startswith("simcluster: interrupted"), result.stderr
    assert "liveness" not in result.stdout  # no example of the spinning hook ever ran


@pytest.mark.parametrize("option, value", [("--world-sizes", "100000"), ("--seed", "99999999999999999999999"),
                                            ("--steps", "0"), ("--examples", "1000000"), ("--deadline", "-1")])
def test_out_of_range_options_exit_2_with_the_range(option, value, tmp_path, monkeypatch, capsys):
    line = _usage_error("check", "--quiet", "--no-database", "simcluster.hooks.reference:mean_allreduce_hook", option,
                        value, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys)
    assert option in line


def _usage_error(*argv: str, cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """Run the command line ``simcluster ARGV`` in ``cwd``, in this process (each check of a
    bad option as a subprocess cost a ~2 s ``import torch``; tests/test_cli.py keeps the
    console script's own path); assert exit 2, one line on stderr and nothing on stdout; the line."""
    from simcluster.cli import main

    monkeypatch.chdir(cwd)
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("simcluster: error: "), (out, err)
    return err


MEAN = "simcluster.hooks.reference:mean_allreduce_hook"


def test_bad_output_paths_and_options_are_one_line_and_exit_2_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each of these once ran (or half ran) and then crashed or was silently ignored (a CI
    user's audit, 2026-12-06): ``--json DIR`` checked everything, then raised IsADirectoryError
    and exited 1 after a passing hook; ``--timeline`` into a missing folder was a traceback;
    ``--database FILE`` never saved; ``--isolate`` of a typo isolated nothing; explain's
    ``--tolerance``/``--world-sizes`` were read only by ``--range`` and ``--range`` drew no
    ``--timeline``; ``--e2e-examples`` without ``--e2e``; a replay on a backend or world
    size the options exclude ran anyway, under a table of backends it never ran."""
    from simcluster.checking.replay import encode_example
    from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec

    (tmp_path / "afile").write_text("hi\n")
    (tmp_path / "hooks.py").write_text("import torch.distributed as dist\n"
                                       "def hook(state, bucket):\n"
                                       "    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()"
                                       ".then(lambda f: f.value()[0] / dist.get_world_size())\n")
    token = encode_example(Example(2, Layout(((2,),), None, (0,)), StepSpec((RankSpec("const", value=1.0),) * 2)),
                           "gloo")
    check = ("check", "--quiet", "--no-database", "--examples", "2")
    says = {
        "is a directory": (*check, MEAN, "--json", str(tmp_path)),
        "is a file, not a directory": ("check", "--quiet", MEAN, "--database", str(tmp_path / "afile")),
        "--isolate nosuchmod: no module named 'nosuchmod'": (*check, "hooks.py:hook", "--isolate", "nosuchmod"),
        "--e2e-examples N: only with --e2e": (*check, MEAN, "--e2e-examples", "5"),
        "the token's example runs on gloo": (*check, "hooks.py:hook", "--replay", token, "--backend", "nccl"),
        "the token's example has world size 2": (*check, "hooks.py:hook", "--replay", token, "--world-sizes", "3"),
        "directory /nonexistent does not exist": ("explain", MEAN, "--timeline", "/nonexistent/x.svg"),
        "--tolerance: only with --range": ("explain", MEAN, "--tolerance", "bf16"),
        "tolerance 'nonsense'": ("explain", MEAN, "--range", "--tolerance", "nonsense"),
        "--timeline: not with --range": ("explain", MEAN, "--range", "--timeline", str(tmp_path / "x.svg")),
    }
    for words, argv in says.items():
        assert words in _usage_error(*argv, cwd=tmp_path, monkeypatch=monkeypatch, capsys=capsys), argv


def test_a_replay_reports_the_backend_it_ran_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from simcluster.checking.replay import encode_example
    from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec
    from simcluster.cli import main

    token = encode_example(Example(2, Layout(((2,),), None, (0,)), StepSpec((RankSpec("const", value=1.0),) * 2)),
                           "gloo")
    out = tmp_path / "r.json"
    assert main(["check", "--quiet", "--no-database", MEAN, "--replay", token, "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["backends"] == ["gloo"]  # was ["gloo", "nccl"]: nccl never ran


@pytest.mark.parametrize("method, test", [("signal", "test_hung_hook_is_reported"),
                                          ("thread", "test_hung_hook_is_reported"),
                                          # the fixture read no limit (set up before the call): pytest-timeout
                                          # killed the test, no report (a CI user's suite, 2026-12-06)
                                          ("signal", "test_hung_hook_is_reported_through_the_fixture")])
def test_pytest_timeout_ends_a_hung_hook_and_says_where(method, test):
    case = HERE / "hostile" / "pytest_timeout_case.py"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(case),
                             "--timeout", "12", "--timeout-method", method, "-o", "addopts=", "-x",
                             "-k", f"{test} and not {test}_"],
                            capture_output=True, text=True, timeout=120, cwd=HERE / "hostile",
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "time.sleep(10_000)" in result.stdout and "liveness" in result.stdout


import importlib.util as _util  # noqa: E402 - the hooks module, loaded once by path

_spec = _util.spec_from_file_location("simcluster_hostile_hooks", HOOKS)
HOOK_MODULE = _util.module_from_spec(_spec)
_spec.loader.exec_module(HOOK_MODULE)


@pytest.mark.parametrize("module, says", [("import_spins", "did not return within 2 s (at tests/hostile/import_spins.py:"),
                                           ("import_exits", "raised SystemExit: 0"),
                                           ("import_kills_itself", "import_kills_itself.py:hook: the process was killed "
                                                                   "by SIGTERM")])
def test_a_target_whose_import_spins_or_exits_is_a_load_error(module, says):
    result = run_cli(f"{HERE / 'hostile' / module}.py:hook", "--deadline", "2")
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and result.stderr.count("\n") == 1


def run_explain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simcluster", "explain", *args],
                          capture_output=True, text=True, timeout=240, cwd=HERE.parent)


def test_explain_of_a_spinning_hook_ends_and_says_where():
    result = run_explain(target("spins"), "--deadline", "2")
    assert result.returncode == 1, result.stderr
    assert "did not return within 2 s" in result.stderr and "in spins" in result.stderr
    assert "stuck at rank 0, DDP step 0, bucket 0" in result.stderr


def test_explain_deadline_is_per_step():
    """Each step gets the whole deadline: a hook taking 0.3 s a call (1 bucket, then 3 after the
    rebuild: ≤ 0.9 s a step, 3.0 s in all over 4 steps) passes a 2 s deadline."""
    result = run_explain(target("slow_but_fine"), "--deadline", "2", "--world-size", "1", "--steps", "4")
    assert result.returncode == 0, result.stderr
    assert "== step 3" in result.stdout


@pytest.mark.parametrize("name, code", [("sys_exit_zero", 0), ("sys_exit_one", 1)])
def test_explain_of_a_hook_calling_sys_exit_fails_and_says_so(name, code):
    result = run_explain(target(name))
    assert result.returncode == 1, (result.stdout, result.stderr)
    failure = result.stdout[result.stdout.index("4. The hook failed at step 0:"):]
    assert f"the hook called sys.exit({code})" in failure and f"hooks.py:{line_of(name, 'sys.exit')} in {name}" in failure


def test_explain_range_of_a_hook_calling_sys_exit_says_it_is_unsafe():
    result = run_explain(target("sys_exit_zero"), "--range", "--world-sizes", "2")
    assert result.returncode == 0, result.stderr
    assert "world 2: not safe even at M = 1: the hook called sys.exit(0)" in result.stdout


def test_explain_of_a_state_factory_calling_sys_exit_fails_and_says_so():
    result = run_explain(target("slow_but_fine"), "--state", target("exiting_state"))
    assert result.returncode == 1, (result.stdout, result.stderr)
    failure = result.stdout[result.stdout.index("4. The hook failed at step 0:"):]
    assert "sys.exit(3)" in failure and f"hooks.py:{line_of('exiting_state', 'sys.exit(3)')} in exiting_state" in failure


def test_a_state_factory_that_exits_or_spins_is_named_as_such():
    """Its sys.exit was "the hook called sys.exit(3)" (the line was the factory's), and a spin
    was "stuck at before the first hook call" (an audit of hostile hooks, 2026-12-07)."""
    report, _ = check("slow_but_fine", state=target("exiting_state"), backends=("gloo",))
    assert "the state factory called sys.exit(3)" in report.failures[0].message, report.failures[0].message
    report, _ = check("slow_but_fine", state=target("spinning_state"), backends=("gloo",), deadline=1.0)
    message = report.failures[0].message
    assert "stuck before the first hook call of the example" in message and "stuck at before" not in message, message


def test_explain_of_a_hook_killing_its_process_says_where():
    result = run_explain(target("kills_itself"))
    assert result.returncode == 1, result.stderr
    assert "the hook's process was killed by SIGKILL; it was at rank 0, DDP step 0, bucket 0" in result.stderr


def test_what_a_stuck_hook_printed_is_in_its_report():
    """The example's output is captured into a file the supervisor owns: a killed child's is kept."""
    report, _ = check("prints_then_spins", deadline=1.0, backends=("gloo",))
    (failure,) = report.failures
    assert failure.property == "liveness" and "did not return within 1 s" in failure.message
    assert failure.output == "rank 0: about to wait for the others"
    result = run_explain(target("prints_then_spins"), "--deadline", "1")
    assert result.returncode == 1
    assert "what the hook printed in that step:\n    rank 0: about to wait for the others" in result.stderr


def test_printed_output_of_a_stuck_run_keeps_its_last_lines() -> None:
    from simcluster.checking.render import MAX_OUTPUT_LINES, printed_output

    shown = printed_output("\n".join(f"line {i}" for i in range(100)), last=True).splitlines()
    assert len(shown) == MAX_OUTPUT_LINES and shown[-1] == "line 99"
    assert shown[0] == f"… {100 - MAX_OUTPUT_LINES + 1} earlier lines (the replay command prints them all)"


# ---------------------------------------------------------------- exit handlers (an audit, 2026-12-07)
EXIT_HANDLERS = str(HERE / "hostile" / "registers_exit_handlers.py") + ":hook"


def test_exit_handlers_of_the_code_under_test_are_not_registered_in_this_process():
    """A rank's exit handlers run when its process ends; the checking process is not that
    process. The module's two and the hook's one per call were registered here for real."""
    import atexit

    before = atexit._ncallbacks()
    report = check_hook(EXIT_HANDLERS, examples=2, world_sizes=(2,), backends=("gloo",), database=None,
                        supervise=False)
    assert not report.passed and report.failures[0].property == "averages", report.format()
    assert atexit._ncallbacks() == before


def test_an_exit_handler_ending_the_process_does_not_turn_a_failed_check_into_exit_0():
    """``atexit.register(os._exit, 0)`` in a hook's module: the CLI printed FAIL and exited 0."""
    result = run_cli(EXIT_HANDLERS, "--examples", "2", "--world-sizes", "2", "--backend", "gloo")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL:averages" in result.stdout and "exit handler ran" not in result.stdout


def test_a_thread_the_targets_import_left_running_does_not_keep_the_check_from_ending():
    """Python waits at exit for every thread that is not a daemon: the check passed, printed
    its table, and never exited. It now names the thread and exits with the verdict's code."""
    result = run_cli(str(HERE / "hostile" / "import_starts_a_thread.py") + ":hook", "--examples", "2",
                     "--world-sizes", "2", "--backend", "gloo", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not waiting for thread 'never_ends' (runs time.sleep)" in result.stderr, result.stderr


def test_a_hook_file_wrapping_all_reduce_at_its_top_to_average_passes_as_on_real_gloo():
    """Each real rank divides once in its own wrapper; shared by the simulated ranks, the
    wrappers nested (W of them, more with every example) and the correct hook failed averages."""
    report = check_hook(str(HERE / "hostile" / "import_wraps_all_reduce_to_average.py") + ":hook", examples=10,
                        world_sizes=(2, 3), database=None)
    assert report.passed, report.format()


@pytest.mark.parametrize("module", ["import_redirects_stdout", "import_changes_directory"])
def test_what_a_targets_import_does_to_stdout_or_the_directory_is_not_the_checking_processs(module, tmp_path):
    """The report went into the module's StringIO (nothing on stdout, exit 1); after its
    ``os.chdir("/")`` the next load of the relative TARGET said "file not found" (exit 2) and a
    relative ``--json`` would have landed in /."""
    (tmp_path / "hooks.py").write_text((HERE / "hostile" / f"{module}.py").read_text())
    result = subprocess.run([sys.executable, "-m", "simcluster", "check", "--quiet", "--no-database", "hooks.py:hook",
                             "--examples", "2", "--world-sizes", "2", "--backend", "gloo", "--json", "report.json"],
                            capture_output=True, text=True, timeout=240, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL:averages" in result.stdout and "replay:" in result.stdout
    assert json.loads((tmp_path / "report.json").read_text())[0]["passed"] is False


def test_a_fork_handler_a_targets_import_registers_does_not_run_in_the_checking_processs_children():
    """The handler ended every supervised child at its start: each example a liveness failure,
    "exited with code 0 without reporting". A rank's fork handlers run when that rank forks."""
    result = run_cli(str(HERE / "hostile" / "import_registers_a_fork_handler.py") + ":hook", "--examples", "2",
                     "--world-sizes", "2", "--backend", "gloo")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ctrl_c_stops_a_check_whose_targets_import_ignores_it(tmp_path):
    """``signal.signal(SIGINT, SIG_IGN)`` at a hook module's top reached the checking process:
    Ctrl-C did nothing; only SIGTERM ended the check. Its import leaves it the handlers it had."""
    proc = _ctrl_c_once_the_hook_runs(str(HERE / "hostile" / "import_ignores_ctrl_c.py") + ":hook", tmp_path)
    try:
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "import_ignores_ctrl_c.py:hook was being checked" in err
