"""Simulated futures against torch's own: ``collect_all``/``wait_all`` over failed inputs.

torch's future semantics need no gloo: each test first asks **real torch** (plain
``torch.futures.Future`` objects, completed by the test) how a combination behaves, then runs
the same combination inside a simulated run, where the futures are ``SimFuture``\\ s
completed by the simulator, and requires the same behaviour. A failed collective's future
and a ``then`` child whose callback raised are *errored* in C++; a future completed with
``set_exception`` holds the exception as its value (``SimFuture.errored`` tells them apart).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from simcluster import SimCluster


def _raise(exc: BaseException) -> Any:
    raise exc


def _outcome(fut: torch.futures.Future) -> tuple[str, str]:
    """``("raised", message's first line)`` or ``("value", type names of the list's items)``."""
    try:
        value = fut.wait()
    except Exception as exc:  # noqa: BLE001 - the answer
        return "raised", str(exc).splitlines()[0]
    return "value", ",".join(type(v).__name__ for v in value)


def _failed_collective() -> torch.futures.Future:
    """Inside a run: gloo fails BAND on floats at wait() (an errored future)."""
    return dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, async_op=True).get_future()


def test_an_errored_input_errors_collect_all_at_once_as_in_torch() -> None:
    # real torch: an errored input (a callback raised) errors the aggregate while another input is pending
    source, pending = torch.futures.Future(), torch.futures.Future()
    errored = source.then(lambda f: _raise(ValueError("in the callback")))
    real = torch.futures.collect_all([pending, errored])
    source.set_result(0)
    assert real.done() and not pending.done()
    assert _outcome(real) == ("raised", "Got the following error when running the callback: ValueError: in the callback")

    def rank_fn(rank: int) -> tuple[bool, tuple[str, str]]:
        pending = torch.futures.Future()
        failed = _failed_collective()
        agg = torch.futures.collect_all([pending, failed])
        try:
            failed.wait()
        except RuntimeError:
            pass
        done_early = agg.done()
        pending.set_result(None)  # let the run end with nothing pending
        return done_early, _outcome(agg)

    for done_early, outcome in SimCluster(2, backend="gloo").run(rank_fn).values:
        assert done_early
        assert outcome == ("raised", "Cannot use ReduceOp.BAND with non-integral dtype")


def test_the_first_errored_input_wins_as_in_torch() -> None:
    first, second = torch.futures.Future(), torch.futures.Future()
    e1 = first.then(lambda f: _raise(ValueError("one")))
    e2 = second.then(lambda f: _raise(ValueError("two")))
    real = torch.futures.collect_all([e1, e2])
    second.set_result(0)  # e2 errors first
    first.set_result(0)
    assert _outcome(real)[1].endswith("ValueError: two")

    def rank_fn(rank: int) -> tuple[str, str]:
        a, b = torch.futures.Future(), torch.futures.Future()
        ea = a.then(lambda f: _raise(ValueError("one")))
        eb = b.then(lambda f: _raise(ValueError("two")))
        agg = torch.futures.collect_all([ea, eb])
        b.set_result(0)
        a.set_result(0)
        return _outcome(agg)

    for outcome in SimCluster(1).run(rank_fn).values:
        assert outcome[0] == "raised" and outcome[1].endswith("ValueError: two"), outcome


def test_set_exception_inputs_raise_in_list_order_once_all_complete_as_in_torch() -> None:
    x, y, pending = torch.futures.Future(), torch.futures.Future(), torch.futures.Future()
    real = torch.futures.collect_all([x, y, pending])
    y.set_exception(ValueError("y, completed first"))
    x.set_exception(ValueError("x, first in the list"))
    assert not real.done()  # no early completion for set_exception inputs
    pending.set_result(1)
    assert _outcome(real) == ("raised", "x, first in the list")

    def rank_fn(rank: int) -> tuple[bool, tuple[str, str]]:
        x, y, pending = torch.futures.Future(), torch.futures.Future(), torch.futures.Future()
        agg = torch.futures.collect_all([x, y, pending])
        y.set_exception(ValueError("y, completed first"))
        x.set_exception(ValueError("x, first in the list"))
        early = agg.done()
        pending.set_result(1)
        return early, _outcome(agg)

    assert SimCluster(2).run(rank_fn).values == [(False, ("raised", "x, first in the list"))] * 2


def test_values_give_the_list_of_futures_and_wait_all_their_values() -> None:
    a, b = torch.futures.Future(), torch.futures.Future()
    a.set_result(1)
    b.set_result(2)
    real = _outcome(torch.futures.collect_all([a, b]))
    assert real == ("value", "Future,Future")

    def rank_fn(rank: int) -> tuple[tuple[str, str], list[Any]]:
        t = torch.full((2,), float(rank + 1))
        fut = dist.all_reduce(t, async_op=True).get_future()
        own = torch.futures.Future()
        own.set_result("mine")
        agg = torch.futures.collect_all([fut, own])
        outcome = ("value", ",".join("Future" for _ in agg.wait()))  # SimFutures stand in for torch's
        return outcome, torch.futures.wait_all([fut, own])

    for outcome, values in SimCluster(2).run(rank_fn).values:
        assert outcome == real
        assert torch.equal(values[0][0], torch.full((2,), 3.0)) and values[1] == "mine"


def test_wait_all_raises_an_errored_inputs_error() -> None:
    def rank_fn(rank: int) -> str:
        try:
            torch.futures.wait_all([_failed_collective()])
        except RuntimeError as exc:
            return str(exc).splitlines()[0]
        return "no error"

    assert SimCluster(2, backend="gloo").run(rank_fn).values == ["Cannot use ReduceOp.BAND with non-integral dtype"] * 2


def test_a_missing_attribute_of_a_future_is_worded_as_torch_words_it() -> None:
    """Measured (docs/gloo-facts.md §8): a collective's future (and ``then``'s) is a
    ``torch._C.Future`` — ``'torch._C.Future' object has no attribute 'nope'``; one the hook
    makes with ``torch.futures.Future()`` says ``'Future' object …``. e2e compares such
    messages byte for byte with real gloo."""
    import torch.distributed as dist

    from simcluster import SimCluster

    def rank_fn(rank: int) -> list[str]:
        fut = dist.all_reduce(torch.ones(1), async_op=True).get_future()
        messages = []
        for obj in (fut, fut.then(lambda f: f.value()), torch.futures.Future()):
            with pytest.raises(AttributeError) as info:
                obj.nope
            messages.append(str(info.value))
        fut.wait()
        return messages

    assert SimCluster(1).run(rank_fn).values[0] == [
        "'torch._C.Future' object has no attribute 'nope'",
        "'torch._C.Future' object has no attribute 'nope'",
        "'Future' object has no attribute 'nope'",
    ]


def test_value_of_a_pending_future_raises_torchs_own_first_line() -> None:
    """``value()`` on a pending future raised simcluster's own words; torch raises an internal
    assert, and e2e compares the first line byte for byte, so a hook confirmed failing on real
    gloo was called a FIDELITY BUG (hooks from the wild, round 19). The first line is now
    torch's, the next says which future and what to do."""
    try:
        torch.futures.Future().value()
    except RuntimeError as real:
        expected = str(real)
    else:
        raise AssertionError("torch's pending future gave a value")

    def rank_fn(rank: int) -> str:
        fut = dist.all_reduce(torch.ones(1), async_op=True).get_future()
        try:
            fut.value()
        except RuntimeError as exc:
            return str(exc)
        finally:
            fut.wait()
        return "no error"

    for text in SimCluster(2).run(rank_fn).values:
        first, _, rest = text.partition("\n")
        assert first == expected, text
        assert rest == "simcluster: value() on the pending all_reduce#0 on WORLD: call wait(), or read it inside a " \
                       "then-callback of it", text


def future_kinds(rank: int, world_size: int = 1, payload: Any = None) -> list[tuple[str, bool, bool]]:
    """For each future a hook meets: is it a ``torch.futures.Future``, does it have
    ``set_exception`` — run on real gloo (a job of ``gloo_world``) and in a simulated run."""
    collective = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    made = torch.futures.Future()
    futures = {"a collective's": collective, "its then's": collective.then(lambda f: f.value()),
               "torch.futures.Future()": made, "made one's then's": made.then(lambda f: f.value()),
               "collect_all's": torch.futures.collect_all([collective])}
    made.set_result(0)
    kinds = [(name, isinstance(fut, torch.futures.Future), hasattr(fut, "set_exception"))
             for name, fut in futures.items()]
    torch.futures.wait_all(list(futures.values()))
    return kinds


def test_which_futures_are_torch_futures_Future_is_as_on_real_gloo(gloo_world: Any) -> None:
    """On real gloo a collective's future, and every ``then``'s and ``collect_all``'s, is a
    ``torch._C.Future``: not a ``torch.futures.Future``, and without ``set_exception``; only
    ``torch.futures.Future()`` is one. Every simulated future was one, so a hook branching on
    ``isinstance(fut, torch.futures.Future)`` took another path than on real gloo (e2e: a
    FIDELITY BUG, an audit of hostile hooks, 2026-12-07)."""
    real = gloo_world(1).run(future_kinds, [None], timeout=120.0)[0]
    assert [kind[1] for kind in real] == [False, False, True, False, False]  # the measured fact, stated
    assert SimCluster(1).run(future_kinds).values[0] == real


def _making_futures(rank: int = 0) -> list[str]:
    """How ``torch.futures.Future(...)`` answers a few ways of calling it."""
    answers = []
    for make in (lambda: torch.futures.Future(devices=["cpu"]), lambda: torch.futures.Future(["cpu"]),
                 lambda: torch.futures.Future(devices=[]), lambda: torch.futures.Future()):
        try:
            make()
            answers.append("made")
        except Exception as exc:  # noqa: BLE001 - the answer
            answers.append(f"{type(exc).__name__}: {exc}")
    return answers


def test_a_future_made_by_hook_code_takes_its_arguments_as_torchs_does() -> None:
    """``torch.futures.Future(devices=["cpu"])`` raises on torch (a CPU device has no index) and
    ``devices`` is keyword-only; the simulated class took any ``devices`` and a positional one."""
    real = _making_futures()
    assert real[0] == "ValueError: Expected devices to have indices, got cpu"  # the measured fact, stated
    assert SimCluster(1).run(_making_futures).values[0] == real
