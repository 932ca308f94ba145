"""Hostile hooks: each a line or two, each doing what a test harness must survive.

Loaded by path (``tests/hostile/hooks.py:NAME``) by tests/test_hostile.py.
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist


def line_of(function, text):
    """The number of the first line of ``function`` (a hook of this file) holding ``text``: tests
    find the lines a report names here, so a hook added above them moves nothing they check."""
    import inspect

    lines, start = inspect.getsourcelines(globals()[function])
    return next(start + i for i, line in enumerate(lines) if text in line)


def _allreduce(bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def sys_exit_zero(state, bucket):
    sys.exit(0)


def sys_exit_one(state, bucket):
    sys.exit(1)


def os_exit_three(state, bucket):
    os._exit(3)


def spins(state, bucket):
    while True:
        pass


def sleeps(state, bucket):
    time.sleep(10_000)


def waits_forever(state, bucket):
    threading.Event().wait()


def spins_after_wait(state, bucket):
    """Blocks in a simulated wait first (so the spinning code runs on a pool thread)."""
    dist.all_reduce(bucket.buffer(), async_op=True).wait()
    while True:
        pass


def raises_keyboard_interrupt(state, bucket):
    raise KeyboardInterrupt


def posts_from_thread(state, bucket):
    """Posts the all_reduce from a thread it starts (and does not join)."""
    box = {}
    future = torch.futures.Future()

    def worker():
        box["work"] = dist.all_reduce(bucket.buffer(), async_op=True)

    threading.Thread(target=worker, daemon=True).start()
    return future


def kills_itself(state, bucket):
    os.kill(os.getpid(), 9)


def kills_its_parent(state, bucket):
    """Kills the process that started it (on a cluster: the launcher, and so the job)."""
    os.kill(os.getppid(), 9)
    return _mean(bucket)


def ignores_the_stack_request_then_spins(state, bucket):
    """Ignores the signal simcluster's supervisor asks for a stack with (a hook that targets it)."""
    import signal

    from simcluster.checking.supervisor import STACK_REQUEST

    signal.signal(STACK_REQUEST, signal.SIG_IGN)
    while True:
        pass


def preempted_on_sigusr1_then_spins(state, bucket):
    """A training job's preemption handler (SLURM sends SIGUSR1 before its time limit; the job
    saves and exits), then stuck."""
    import signal

    signal.signal(signal.SIGUSR1, lambda signum, frame: sys.exit(0))
    while True:
        pass


def stops_itself(state, bucket):
    os.kill(os.getpid(), 19)  # SIGSTOP: nothing but a SIGCONT from outside goes on from here
    return _mean(bucket)


def slow_but_fine(state, bucket):
    """Takes its time (0.3 s a call on rank 0: an example takes longer than Hypothesis' own
    200 ms deadline) and then averages correctly: slowness under the deadline is no finding."""
    if dist.get_rank() == 0:  # one slow rank is enough, and halves the tests' time at world 2
        time.sleep(0.3)
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


THREAD_ERRORS: list = []


def posts_from_joined_thread(state, bucket):
    """Starts a thread that posts a collective, joins it, keeps what it raised, then averages normally."""
    def worker():
        try:
            dist.all_reduce(bucket.buffer(), async_op=True)
        except Exception as exc:  # noqa: BLE001 - kept for the test to look at
            THREAD_ERRORS.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def exiting_state(process_group):
    """A state factory (``--state``) that ends its process before any hook call."""
    sys.exit(3)


def prints_then_spins(state, bucket):
    """Says what it is about to do, then never returns."""
    print(f"rank {dist.get_rank()}: about to wait for the others")
    while True:
        time.sleep(0.01)


def rank0_callback_kills_process(state, bucket):
    """Rank 0's ``then`` callback ends its process (``SIGKILL``, as a fault-injection hook from
    the wild does to "simulate a failure"): by then rank 1's hook call has started, so the
    last hook call announced is rank 1's while the code that killed the process is rank 0's."""
    def done(fut):
        if dist.get_rank() == 0:
            os.kill(os.getpid(), 9)
        return fut.value()[0]

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(done)


_POOL = None


def _pool():
    from concurrent.futures import ThreadPoolExecutor

    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1)
    return _POOL


def averages_on_a_pool_thread(state, bucket):
    """Hands the whole synchronous all_reduce to a one-worker ThreadPoolExecutor, which completes
    the future the hook returned (a constructed probe of hooks from the wild): correct on a
    real cluster, where the pool thread uses its own process's group."""
    buf = bucket.buffer()
    fut = torch.futures.Future()

    def work():
        dist.all_reduce(buf)
        fut.set_result(buf.div_(dist.get_world_size()))

    _pool().submit(work)
    return fut


def compresses_on_a_pool_thread(state, bucket):
    """Only arithmetic on the pool's thread (waited for), the all_reduce on the rank's own path."""
    buf = bucket.buffer()
    buf.copy_(_pool().submit(lambda: buf.to(torch.float16)).result())
    return _allreduce(type("B", (), {"buffer": lambda self: buf.div_(dist.get_world_size())})())


def _announce(name: str) -> None:
    """Tell a test that this hook's code is running: a file ``name.<pid>`` in the folder
    ``SIMCLUSTER_TEST_STARTED`` names (nothing without it). A test that signals a run waits
    for it, not for processes to exist: a checking process forks before it draws its example,
    builds the cluster and loads the hook, and a signal sent then finds none of this code."""
    folder = os.environ.get("SIMCLUSTER_TEST_STARTED")
    if folder:
        open(os.path.join(folder, f"{name}.{os.getpid()}"), "w").close()


def spins_announced(state, bucket):
    _announce("spins")
    while True:  # spins here
        pass


def sleeps_announced(state, bucket):
    _announce("sleeps")
    time.sleep(10_000)  # sleeps here


# ---------------------------------------------------------------- os._exit caught, forks (an audit, 2026-12-07)
def _mean(bucket):
    bucket.buffer().div_(dist.get_world_size())
    return _allreduce(bucket)


def os_exit_caught(state, bucket):
    """A clean-up path that tries to end the process and ignores whatever goes wrong."""
    try:
        os._exit(1)
    except Exception:
        pass
    return _mean(bucket)


class _ExitsWhenCollected:
    def __del__(self):
        os._exit(0)  # Python only prints what a __del__ raises


def os_exit_in_del(state, bucket):
    _ExitsWhenCollected()
    return _mean(bucket)


def os_exit_in_joined_thread(state, bucket):
    watchdog = threading.Thread(target=os._exit, args=(3,))
    watchdog.start()
    watchdog.join()
    return _mean(bucket)


def forks_a_child_that_exits(state, bucket):
    """Correct: the child leaves at once with os._exit(0), the hook waits for it."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return _mean(bucket)


def forks_a_child_that_raises(state, bucket):
    """Correct for its parent: the forked child raises, back into the code that called the hook."""
    pid = os.fork()
    if pid == 0:
        raise RuntimeError("the forked child")
    os.waitpid(pid, 0)
    return _mean(bucket)


def joins_a_multiprocessing_fork(state, bucket):
    """Correct: a multiprocessing (fork) child doing nothing, joined; it leaves with os._exit."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the child exited with {child.exitcode}")
    return _mean(bucket)


STARTED_PROCESS = ["sleep", "600.0417"]
"""What :func:`starts_a_process_each_call` runs (an argument no other process on the machine has)."""


def starts_a_process_each_call(state, bucket):
    """Correct, but starts a process at every call and leaves it running."""
    import subprocess

    subprocess.Popen(STARTED_PROCESS, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _mean(bucket)


SESSION_PROCESS = ["sleep", "600.0418"]
"""What :func:`starts_a_session_each_call` and :func:`starts_a_session_then_spins` run."""

ORPHAN_PROCESS = ["sleep", "600.0419"]
"""What :func:`leaves_an_orphan_each_call` leaves behind."""


def starts_a_session_each_call(state, bucket):
    """Correct, but starts a process in a session of its own at every call (it leaves the
    process group that ends with the example) and leaves it running."""
    import subprocess

    subprocess.Popen(SESSION_PROCESS, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    return _mean(bucket)


def leaves_an_orphan_each_call(state, bucket):
    """Correct, but at every call a shell starts a process in a session of its own and
    exits: the process is an orphan whose parent no longer exists (a daemon's double fork)."""
    import subprocess

    subprocess.run(["sh", "-c", f"setsid {' '.join(ORPHAN_PROCESS)} </dev/null >/dev/null 2>&1 &"], check=True)
    return _mean(bucket)


def starts_a_session_then_spins(state, bucket):
    """Starts a process in a session of its own, then spins: ended at the deadline."""
    import subprocess

    subprocess.Popen(SESSION_PROCESS, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    while True:
        pass


_pushed = []


def pushes_the_clock_ahead_then_spins(state, bucket):
    """First example: replaces time.monotonic with a clock 10^9 s ahead. Any later one: spins."""
    if _pushed:
        while True:
            pass
    _pushed.append(time.monotonic)
    time.monotonic = lambda: _pushed[0]() + 1e9
    return _mean(bucket)


def says_its_string_order(state, bucket):
    """Fails on purpose, naming the hash seed and the order of a set of strings."""
    order = list({f"key{i}" for i in range(8)})
    raise RuntimeError(f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED')} order={order}")


class BaseOfItsOwn(BaseException):
    """Neither an Exception nor a stop request: it ends a real rank's process as any uncaught error."""


def raises_a_base_exception_of_its_own(state, bucket):
    raise BaseOfItsOwn("the hook's own BaseException")


class InterruptOfItsOwn(KeyboardInterrupt):
    pass


def raises_a_keyboard_interrupt_of_its_own(state, bucket):
    raise InterruptOfItsOwn()


def leaves_a_raising_tracer(state, bucket):
    """A trace function left behind, which raises in whatever code runs 20,000 events later
    (simcluster's engine, the judge, Hypothesis) unless the run's end puts it back first.
    (At 2,000 it came to raise inside rank 1's own hook call once the hot path grew: that
    rank's failure, another case of the test.)"""
    events = [0]

    def tracer(frame, event, arg):
        events[0] += 1
        if events[0] > 20000:
            raise RuntimeError("the tracer says stop")
        return tracer
    sys.settrace(tracer)
    return _allreduce(bucket)


def leaves_a_tracer_raising_in_the_engine(state, bucket):
    """A trace function that raises when simcluster's engine completes a collective."""
    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_complete_one":
            raise RuntimeError("the tracer stops the engine")
    sys.settrace(tracer)
    return _allreduce(bucket)


def leaves_a_raising_profiler(state, bucket):
    events = [0]

    def profiler(frame, event, arg):
        events[0] += 1
        if events[0] > 500:
            raise RuntimeError("the profiler says stop")
    sys.setprofile(profiler)
    return _allreduce(bucket)


def sends_itself_sigint(state, bucket):
    """Python's default SIGINT handler raises KeyboardInterrupt here: a real rank ends."""
    import signal
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)
    return _allreduce(bucket)


def spinning_state(process_group):
    """A state factory that never returns (DDP calls it before any hook call)."""
    while True:
        continue


def leaves_a_raising_gc_callback(state, bucket):
    """Every garbage collection from now on raises in a callback Python then "ignores"."""
    import gc

    def callback(phase, info):
        raise RuntimeError("a gc callback raises")
    if not any(getattr(c, "__name__", "") == "callback" for c in gc.callbacks):
        gc.callbacks.append(callback)
    for _ in range(20):
        gc.collect(0)  # the youngest generation: fast
    return _allreduce(bucket)


def dies_at_its_processes_twelfth_call(state, bucket):
    """Kills its process at the process's 12th hook call, counted where every rank and every
    example of the process sees it (an attribute of the ``threading`` module): an example
    that dies in a search passes alone in a fresh process."""
    import signal
    threading.hook_calls_in_this_process = getattr(threading, "hook_calls_in_this_process", 0) + 1
    if threading.hook_calls_in_this_process == 12:
        os.kill(os.getpid(), signal.SIGKILL)
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def calls_pytest_skip(state, bucket):
    """Outside a test, ``pytest.skip()`` raises a ``BaseException`` that ends a real rank."""
    import pytest

    pytest.skip("this hook decided to skip")


def thread_posts_on_the_first_call_only(state, bucket):
    """Its first call in the process posts from a thread of its own (rejected: not modelled);
    no later call does — so Hypothesis, re-running the example, calls the failure flaky."""
    if not getattr(sys, "_simcluster_test_thread_posted", False):
        sys._simcluster_test_thread_posted = True
        copy = bucket.buffer().clone()
        thread = threading.Thread(target=lambda: dist.all_reduce(copy))
        thread.start()
        thread.join()
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def closes_every_file_descriptor(state, bucket):
    """Closes the process's files, simcluster's own included: the example returns, and its
    process cannot report it (on a real rank: its gloo connections are gone)."""
    os.closerange(3, 4096)
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def closes_its_stdout(state, bucket):
    """Closes file descriptor 1 (rank 1 then finds it closed): harmless to a real rank that
    prints nothing after."""
    try:
        os.close(1)
    except OSError:
        pass
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


class Unprintable(Exception):
    def __str__(self):
        raise ValueError("no words for it")


def raises_an_unprintable_error(state, bucket):
    raise Unprintable()
