"""Simulated futures: real torch futures that complete on the engine's say.

A :class:`SimFuture` *is* a ``torch._C.Future`` — what a collective's ``get_future()`` and
every ``then`` return on real gloo (``value()``, ``done()``, ``set_result`` behave as
torch's do; like torch's, it has no ``set_exception``, and ``isinstance(fut,
torch.futures.Future)`` is False: measured on torch 2.13). The future hook code makes with
``torch.futures.Future()`` is the subclass the run puts in that name's place
(:func:`~simcluster.fake.rank_context.user_future_class`), a ``torch.futures.Future`` too, as
torch's is. Three changes keep the engine in control:

* ``then(cb)`` returns another :class:`SimFuture` (torch's would return a plain C++
  future whose ``wait`` the engine could not see);
* ``wait()`` on a pending future parks the calling rank's code and lets the other
  ranks run (torch's would block the only running thread: a guaranteed hang);
* callbacks are recorded in the trace with *where* they ran.

Behaviours kept from torch (measured on 2.13, see ``docs/``):

* a ``then`` callback on a pending future runs in the code that completes it (for a
  collective: the backend's context, e.g. a gloo worker thread); on a complete one it
  runs at once, inline, in the caller;
* callbacks run in registration order;
* an exception raised in a ``then`` callback completes the derived future with
  ``RuntimeError("Got the following error when running the callback: <Type>: <msg>…")``,
  raised by ``wait()`` and ``value()`` (we keep the original as ``__cause__``);
* an exception in an ``add_done_callback`` callback is logged and swallowed;
* a callback that returns a Future gives a Future *of* a Future (no unwrapping);
* ``value()`` on a pending future raises ``RuntimeError`` (torch: an internal assert);
* completing a future twice raises ``RuntimeError``.

Example — a rank's code chaining on a collective (run inside a cluster)::

    fut = dist.all_reduce(t, async_op=True).get_future()   # pending SimFuture
    doubled = fut.then(lambda f: f.value()[0] * 2)          # pending SimFuture
    doubled.wait()          # this rank parks; others run; the scheduler completes it
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import torch

from simcluster.engine.frames import is_internal, is_simcluster_code, short_path
from simcluster.engine.trace import CallbackRan
from simcluster.names import MASKED_ADDRESS, callable_name, wear_torchs_name

if TYPE_CHECKING:
    from types import FrameType

    from simcluster.engine.contract import EngineContract

__all__ = ["SimFuture", "DoneFlag", "collect_all", "wait_all", "callback_error", "callback_exception", "CALLBACK_ERROR",
           "in_grad_mode", "holds_cpp_value", "NOT_A_PYOBJECT"]

_log = logging.getLogger("simcluster")
_C_FUTURE_INIT = torch._C.Future.__init__
# torch.futures.Future's set_result/value/wait only call these (measured on 2.13): called
# directly, one Python frame fewer per call on the hot path.
_C_SET_RESULT = torch._C.Future.set_result
_C_VALUE = torch._C.Future.value
_C_WAIT = torch._C.Future.wait
_C_SET_UNWRAP = torch._C.Future._set_unwrap_func
_GUARD = threading.Lock()
"""Makes "check pending, then append a callback or waiter" atomic with "mark complete, then
take the lists", for every :class:`SimFuture` and :class:`DoneFlag`. Only the free-running
engine (:mod:`simcluster.engine.threaded`) completes futures while other threads register
callbacks. One lock for all: each section it guards is a few C operations that call no
other code, so none waits for long and none nests; and no lock is made per future (three per
collective and rank). A forked child (supervised checks fork) gets a fresh one: a thread of the
parent may have held it at the fork."""


def _fresh_guard_after_fork() -> None:
    global _GUARD
    _GUARD = threading.Lock()


os.register_at_fork(after_in_child=_fresh_guard_after_fork)
_grad_enabled, _set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled  # per thread, C calls


def polled_by_user(engine: "EngineContract", waitable: Any, caller: FrameType | None) -> None:
    """``waitable`` was found pending by a poll — ``Future.done()``, ``Work.is_completed()``
    — called from ``caller``: when that is the code under test, inside its run, the other
    ranks and the backend make progress before it looks again
    (:meth:`~simcluster.engine.contract.EngineContract.let_others_run`), as a real backend's
    threads complete collectives while a rank polls. The simulator's own polls (DDP's
    reducer model, the contract checks) and torch's do not: they look, and go on."""
    if engine.running and caller is not None and not is_internal(caller.f_code.co_filename):
        engine.let_others_run(waitable, f"{short_path(caller.f_code.co_filename)}:{caller.f_lineno}")


def in_grad_mode(mode: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with this thread's grad mode set to ``mode``, then set back (also when
    it raises). Grad mode is per thread, and on a real rank hook code runs on threads of
    two kinds: DDP calls the hook from the autograd engine (grad off), gloo runs completion
    callbacks on its worker threads (grad on) — measured, docs/gloo-facts.md §3. The
    simulator runs both on its own threads and sets the mode the real thread would have."""
    before = _grad_enabled()
    if before is mode:
        return fn(*args)
    _set_grad_enabled(mode)
    try:
        return fn(*args)
    finally:
        _set_grad_enabled(before)


CALLBACK_ERROR = "Got the following error when running the callback"
"""How torch's C++ ``then`` begins the message of a callback's exception (then ``: <Type>: <msg>``)."""


NOT_A_PYOBJECT = ('result.isPyObject() INTERNAL ASSERT FAILED at '
                  '"/__w/pytorch/pytorch/torch/csrc/distributed/c10d/python_comm_hook.cpp":41, please report a bug '
                  'to PyTorch. expected the hook result is a PyObject')
"""What real DDP (torch 2.13.0 CPU build) raises from ``backward()`` for a Python hook whose future holds
a C++ value (:func:`holds_cpp_value`), word for word (measured:
``benchmarks/measure_hook_future_kinds.py``, docs/ddp-facts.md "Copy-back (measured)")."""


def holds_cpp_value(future: Any) -> bool:
    """Whether real torch's counterpart of ``future`` holds its value as a C++ value, not a
    Python object: a collective's own future (``work.get_future()``: a C++ list of its
    tensors, ``[]`` for a barrier) or ``torch.futures.collect_all``'s (a C++ list of futures).
    A future Python made — ``torch.futures.Future()`` (the per-cluster ``Future`` subclass) or
    a ``then`` child (its callback's return value) — holds a Python object.

    It matters once, where DDP's Python-hook path reads the hook's result: it refuses a C++
    value outright (:data:`NOT_A_PYOBJECT`), before the cast that turns a Python list into
    ``Unable to cast [...] to Tensor`` (measured on real gloo for all_reduce, all_gather,
    barrier, a waited all_reduce and collect_all: docs/ddp-facts.md).
    """
    return type(future) is SimFuture and not future.label.startswith("then(")


def callback_error(exc: BaseException) -> RuntimeError:
    """The error torch puts in a ``then``-derived future when the callback raises.

    Its ``At:`` lines are the callback's frames, innermost first, as pybind11 lists them for
    a callback C++ called: the frame that caught ``exc`` (the caller of the callback, not
    one of its frames) is left out, and so are the frames a real run has no Python for:
    simcluster's own (a :class:`SimFuture`'s ``wait``/``value`` is C++ in torch) and the
    ``raise_error`` unwrap they enter (an errored C++ future raises from C++; measured: a
    quantization hook's outer block on real gloo is its one callback frame).
    """
    tb = exc.__traceback__
    frames = _real_frames(traceback.extract_tb(tb.tb_next if tb is not None else None))
    at = "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
    error = RuntimeError(
        f"{CALLBACK_ERROR}: {type(exc).__name__}: {exc}\n\nAt:\n{at}"
    )
    error.__cause__ = exc
    error._simcluster_callback_exception = exc  # type: ignore[attr-defined] - see callback_exception
    return error


def _real_frames(frames: traceback.StackSummary) -> list[traceback.FrameSummary]:
    """``frames`` (outermost first) without simcluster's own and the torch frames entered from them."""
    kept: list[traceback.FrameSummary] = []
    after_ours = False
    for frame in frames:
        if is_simcluster_code(frame.filename):
            after_ours = True
        elif not (after_ours and frame.name == "raise_error"):
            kept.append(frame)
            after_ours = False
    return kept


def callback_exception(error: BaseException) -> BaseException | None:
    """The exception a ``then`` callback raised, if ``error`` is the one
    :func:`callback_error` made of it (else ``None``).

    Torch's C++ ``then`` marks the derived future as *errored*; a Python future can only be
    completed with the error as its *value* (``set_exception`` is ``set_result`` plus an
    unwrap function). Code that hands a :class:`SimFuture` to C++ (the real reducer,
    :mod:`simcluster.ddp.real_ddp`) uses this to re-raise the original in a C++ ``then``,
    which wraps it exactly once, as torch does.
    """
    return getattr(error, "_simcluster_callback_exception", None)


def _raise_it(error: BaseException) -> Any:
    """The unwrap function of a future completed with an exception: ``wait()`` and ``value()`` raise it."""
    raise error


class SimFuture(torch._C.Future):
    """A future owned by one simulated rank, completed by the engine or by user code.

    A ``torch._C.Future``, as a collective's and a ``then``'s future is on real gloo: until
    2026-12-07 it was a ``torch.futures.Future``, so a hook's ``isinstance(fut,
    torch.futures.Future)`` was True here and False on real gloo, and a hook branching on it
    took another path (``simcluster e2e``: FIDELITY BUG); and ``fut.set_exception`` worked
    here where torch's collective future has no such method.

    ``label`` names it in traces and deadlock reports (``"all_reduce#3 on WORLD"``,
    ``"then(decompress) of all_reduce#3 on WORLD"``).
    """

    # Slots, not the instance dict, for the attributes the simulator reads and writes (a
    # dozen per collective and rank): torch's pybind allocator leaves a subclass instance's
    # dict unprepared, so every dict attribute takes the interpreter's slow generic path,
    # while a slot is a fixed offset the interpreter specialises (-4.4 % of a W=8 step,
    # docs/speed.md). Instances keep a dict for attributes user code sets, as torch's do.
    __slots__ = ("_engine", "_rank", "label", "_callbacks", "_resumers", "_complete", "_errored")

    def __repr__(self) -> str:
        # As torch's default repr words it (measured on torch 2.13): a collective's or
        # then()'s future is a torch.Future, torch.futures.Future() a torch.jit.Future —
        # never this class, which the user did not write; the address masked (no id()
        # reaches a report). Real DDP quotes it: 'Unable to cast <torch.Future object at …>'.
        kind = "torch.jit.Future" if isinstance(self, torch.futures.Future) else "torch.Future"
        return f"<{kind} object at {MASKED_ADDRESS}>"

    def __init__(self, engine: "EngineContract", rank: int, label: str) -> None:
        _C_FUTURE_INIT(self, [])  # what torch.futures.Future() does with no devices, minus its wrapper (hot path)
        self._engine = engine
        self._rank = rank
        self.label = label
        # (callback, its name, the ``then`` child it completes, or None for add_done_callback)
        self._callbacks: list[tuple[Callable[["SimFuture"], Any], str, SimFuture | None]] = []
        self._resumers: list[Callable[[], None]] = []
        self._complete = False
        self._errored = False

    engine = property(attrgetter("_engine"), doc="The engine of the run this future belongs to (it completes it, "
                      "and waits go through it). A C getter: read once per collective and rank.")

    @property
    def rank(self) -> int:
        """The simulated rank that owns this future (-1: made outside any rank's code)."""
        return self._rank

    # -- completion -----------------------------------------------------------
    def done(self) -> bool:
        if self._complete:
            return True
        polled_by_user(self._engine, self, sys._getframe(1))
        return self._complete

    # A future may be completed only by code the engine runs (not by a thread a hook
    # started): otherwise the run's outcome would depend on that thread's timing. Checked
    # inline in set_result/set_exception; the simulator's own completions skip it (_resolve).

    def set_result(self, result: Any) -> None:
        engine = self._engine
        if engine.running:
            engine.check_thread(f"completing {self.label}")
        self._resolve(result)

    def _resolve(self, result: Any) -> None:
        """:meth:`set_result` without the thread check, for the completions the simulator
        makes on a thread that is already known to be the engine's: a collective's delivery
        (:meth:`DoneFlag.deliver`, an engine task) and a ``then`` child completed by its
        callback while its parent completes (which passed the check, or is a delivery).
        Twice per collective and rank: the check's message and call cost ~1 % of a step."""
        if self._complete:
            raise RuntimeError(
                "Attempting to mark a completed Future as complete again. "
                "Note that a Future can only be marked completed once."
            )
        _C_SET_RESULT(self, result)
        self._finish()

    def _set_exception(self, result: BaseException) -> None:
        """Complete with ``result`` as the value, which ``wait()`` and ``value()`` raise: what
        ``torch.futures.Future.set_exception`` does, for the simulator's own completions of
        futures user code cannot call it on (a collective's, a ``then``'s, ``collect_all``'s)."""
        engine = self._engine
        if engine.running:
            engine.check_thread(f"completing {self.label}")
        _C_SET_UNWRAP(self, _raise_it)
        self._resolve(result)

    def set_error(self, error: BaseException) -> None:
        """Complete this future *errored*, as C++ does when a collective fails or a ``then``
        callback raises: ``wait()``/``value()`` raise ``error`` (as after ``set_exception``)
        and :attr:`errored` is true. The difference matters to DDP's C++ reducer: it raises
        an errored future's error from ``backward()``, while a future completed with
        ``set_exception`` holds the exception as its *value*, which the reducer fails to
        cast to a tensor (measured, docs/ddp-facts.md). Python has no way to error a C++
        future; the simulator's completions use this."""
        self._errored = True
        self._set_exception(error)

    @property
    def errored(self) -> bool:
        """True once completed by :meth:`set_error` (a failed collective, a raising callback)."""
        return self._errored

    def _finish(self) -> None:
        # Waiters are queued first (they run after this code finishes or parks), then
        # callbacks run here: as on gloo, ``fut.wait()`` returns once the value is set,
        # even while a callback is still blocked.
        with _GUARD:
            self._complete = True
            resumers, self._resumers = self._resumers, []
            callbacks, self._callbacks = self._callbacks, []
        for resume in resumers:
            resume()
        for callback, name, child in callbacks:
            self._run_callback(callback, name, child, "completion")

    def on_done(self, resume: Callable[[], None]) -> None:
        """Call ``resume`` once this future completes (at once if it has): how the engine
        learns that a waiter may resume (:class:`~simcluster.engine.contract.Waitable`)."""
        with _GUARD:
            if not self._complete:
                self._resumers.append(resume)
                return
        resume()

    # -- waiting --------------------------------------------------------------
    def wait(self) -> Any:
        if not self._complete:
            self._engine.block_until(self)
        return _C_WAIT(self)

    def value(self) -> Any:
        if not self._complete:
            try:  # torch's own error for a pending future, its first line word for word (what e2e compares)
                return _C_VALUE(self)
            except RuntimeError as exc:  # and on the next line, which future and what to do (a then()
                # callback's error reaches DDP as its message alone: a note would be lost)
                raise RuntimeError(f"{exc}\nsimcluster: value() on the pending {self.label}: call wait(), or read it "
                                   "inside a then-callback of it") from None
        return _C_VALUE(self)

    # -- chaining -------------------------------------------------------------
    def then(self, callback: Callable[["SimFuture"], Any]) -> "SimFuture":  # type: ignore[override]
        name = getattr(callback, "__qualname__", None) or callable_name(callback)  # callable_name's first rule, inline (hot)
        child = SimFuture(self._engine, self._rank, f"then({name}) of {self.label}")
        self._register(callback, name, child)
        return child

    def add_done_callback(self, callback: Callable[["SimFuture"], None]) -> None:  # type: ignore[override]
        self._register(callback, getattr(callback, "__qualname__", None) or callable_name(callback), None)

    def _register(self, callback: Callable[["SimFuture"], Any], name: str, child: SimFuture | None) -> None:
        with _GUARD:
            if not self._complete:
                self._callbacks.append((callback, name, child))
                return
        self._run_callback(callback, name, child, "inline")

    def _run_callback(self, callback: Callable[["SimFuture"], Any], name: str, child: SimFuture | None,
                      how: str) -> None:
        """Trace and run one callback: a ``then`` callback completes ``child`` with its
        result (or with :func:`callback_error`, as torch stores it); an
        ``add_done_callback`` one (``child`` None) has an exception logged and swallowed."""
        engine = self._engine
        rank = engine.current_rank
        if name and rank is not None and engine.running:  # name "": simcluster's own, untraced
            where = "inline" if how == "inline" else (engine.where or "completion")
            engine.trace.log((CallbackRan, (rank, self.label, name, where, self._errored)))
        if child is None:
            try:
                callback(self)
            except Exception as exc:  # noqa: BLE001 - torch logs and swallows it
                _log.error(CALLBACK_ERROR + ": %s: %s", type(exc).__name__, exc)
            return
        try:
            result = callback(self)
        except Exception as exc:  # noqa: BLE001 - torch stores it in the derived future, errored
            child.set_error(callback_error(exc))
        else:
            if how == "completion":  # on the completing thread, checked already (see _resolve)
                child._resolve(result)
            else:  # registered on a complete future: the caller's thread, not checked yet
                child.set_result(result)


class DoneFlag:
    """A value-less waitable: "this work's callbacks have run" (what ``Work.wait()`` waits on).

    Set once by the engine right after the work's future completed and ran its
    callbacks. Not a :class:`SimFuture` — one C++ future fewer per collective call on
    the hot path; the engine only needs ``label``, ``done()`` and ``on_done``
    (:class:`~simcluster.engine.contract.Waitable`). ``in_flight``, if given, is a dict
    the flag sits in (as a key) until it is set: its group's unfinished work on that rank,
    what a gloo barrier waits for (:class:`~simcluster.fake.process_group.SimProcessGroup`).

    ``grad_mode`` is the grad mode the completion's callbacks run under: the thread that
    runs them on the real backend has its own (``torch.is_grad_enabled()`` is per thread).
    """

    __slots__ = ("_future", "_grad_mode", "_complete", "_resumers", "_in_flight")

    def __init__(self, future: SimFuture, in_flight: dict["DoneFlag", None] | None = None,
                 grad_mode: bool = True) -> None:
        self._future = future
        self._grad_mode = grad_mode
        self._complete = False
        self._resumers: list[Callable[[], None]] = []
        self._in_flight = in_flight
        if in_flight is not None:
            in_flight[self] = None

    @property
    def label(self) -> str:
        return f"work of {self._future.label} (its callbacks)"

    @property
    def synchronous_label(self) -> str:
        """What a rank blocked in a *synchronous* collective (``async_op=False``: torch's
        front end waits on the work inside the call) waits on, in the user's words: the
        hook never wrote a ``wait()``, it called ``dist.all_reduce(t)``."""
        return f"the synchronous {self._future.label} (async_op=False: torch waits inside the call)"

    def done(self) -> bool:
        return self._complete

    def failure(self) -> tuple[str, BaseException] | None:
        """``(label of the work's future, the error its wait() raises)`` when the work failed
        (a collective the backend refused at ``wait()``), else None. A gloo barrier posted
        while this work was unfinished re-raises that error (measured, docs/gloo-facts.md)."""
        if not self._future.errored:
            return None
        return self._future.label, _exception_of(self._future)  # type: ignore[return-value] - errored: one exists

    def set(self) -> None:
        with _GUARD:
            self._complete = True
            resumers, self._resumers = self._resumers, []
        if self._in_flight is not None:
            self._in_flight.pop(self, None)  # one C call (identity hash): atomic under the GIL
        for resume in resumers:
            resume()

    def deliver(self, outcome: tuple[Any, BaseException | None]) -> None:
        """Complete the work with a collective's ``(value, exception)`` for this rank:
        its future first (running its callbacks, under the work's grad mode), then this
        flag. The engine calls it as the completion task, so no closure is made per
        collective and rank."""
        if _grad_enabled() is self._grad_mode:  # the usual case: no switch, no extra frame (hot path)
            self._complete_future(outcome)
        else:
            in_grad_mode(self._grad_mode, self._complete_future, outcome)
        self.set()

    def _complete_future(self, outcome: tuple[Any, BaseException | None]) -> None:
        value, exc = outcome
        if exc is not None:
            self._future.set_error(exc)
        else:
            self._future._resolve(value)  # noqa: SLF001 - an engine task: on the engine's thread

    def on_done(self, resume: Callable[[], None]) -> None:
        """Call ``resume`` once the work's callbacks have run (at once if they have)."""
        with _GUARD:
            if not self._complete:
                self._resumers.append(resume)
                return
        resume()

    def wait(self, synchronous: bool = False) -> None:
        """Block until the work's callbacks ran. ``synchronous``: the wait is the one torch's
        front end makes inside a collective called with ``async_op=False`` — the trace and a
        deadlock report then name the synchronous call, not a ``wait()`` the user never wrote."""
        if not self._complete:
            self._future.engine.block_until(_Synchronous(self) if synchronous else self)


class _Synchronous:
    """A :class:`DoneFlag` as the waitable of a synchronous collective: the same flag under
    :attr:`DoneFlag.synchronous_label` (:class:`~simcluster.engine.contract.Waitable`)."""

    __slots__ = ("_flag",)

    def __init__(self, flag: DoneFlag) -> None:
        self._flag = flag

    @property
    def label(self) -> str:
        return self._flag.synchronous_label

    def done(self) -> bool:
        return self._flag.done()

    def on_done(self, resume: Callable[[], None]) -> None:
        self._flag.on_done(resume)


wear_torchs_name(SimFuture, torch._C.Future)
"""A collective's or ``then``'s future is a ``torch._C.Future`` in Python's errors (measured,
docs/gloo-facts.md §8); one the hook made with ``torch.futures.Future()`` (the per-cluster
subclass named ``Future``: :func:`~simcluster.fake.rank_context.user_future_class`) says
``'Future'``, as torch's Python subclass does."""


def collect_all(futures: Sequence[torch.futures.Future]) -> torch.futures.Future:
    """Simulated ``torch.futures.collect_all``: a SimFuture of the list of input futures.

    torch's own returns a plain C++ future whose ``wait`` would block the run's only
    thread; inside a run this version is patched in its place. What it does, as torch's
    (measured on torch 2.13, docs/collectives.md §9):

    * it completes with the list once every input has completed;
    * an *errored* input (a failed collective, a raising ``then`` callback:
      :attr:`SimFuture.errored`) errors it with that input's error as soon as that input
      completes — the first to error wins — even while other inputs are pending;
    * otherwise, if an input holds an exception (``set_exception``), its ``wait()`` and
      ``value()`` raise the first such input's exception in list order.
    """
    sims = [f for f in futures if isinstance(f, SimFuture)]
    if not sims:
        return _plain_collect_all(futures)
    first = sims[0]
    out = SimFuture(first.engine, first.rank, f"collect_all of {len(futures)} futures")
    remaining = [len(futures)]
    items = list(futures)

    def one_done(fut: Any) -> None:
        if out.done():  # an errored input completed it already
            return
        if isinstance(fut, SimFuture) and fut.errored:
            out.set_error(_exception_of(fut))
            return
        remaining[0] -= 1
        if remaining[0] == 0:
            raised = next((e for e in map(_exception_of, items) if e is not None), None)
            if raised is not None:
                out._set_exception(raised)  # noqa: SLF001 - the same module's class
            else:
                out.set_result(items)

    for fut in items:
        if isinstance(fut, SimFuture):
            # untraced: torch's collect_all counts in C++, no callback of the user's runs
            fut._register(one_done, "", None)  # noqa: SLF001 - the same module's class
        elif fut.done():
            one_done(fut)
        else:
            raise NotImplementedError(
                "collect_all mixing simulated futures with a pending plain torch Future is not supported"
            )
    return out


def _exception_of(fut: torch.futures.Future) -> BaseException | None:
    """The exception a completed future's ``value()`` raises, or None."""
    try:
        fut.value()
    except Exception as exc:  # noqa: BLE001 - the answer
        return exc
    return None


def wait_all(futures: Sequence[torch.futures.Future]) -> list[Any]:
    """Simulated ``torch.futures.wait_all``: waits on each future in turn."""
    return [fut.wait() for fut in collect_all(futures).wait()]


_plain_collect_all = torch.futures.collect_all
