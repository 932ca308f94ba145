"""Judging one example: run it on a simulated DDP, apply the oracles in order, raise the first violation.

:func:`run_example` runs :class:`~simcluster.ddp.model.SimDDP` on an
:class:`~simcluster.checking.strategies.Example` and applies the oracles of
:mod:`simcluster.checking.properties` in a fixed order — liveness, contract,
replicas_agree, averages, schedule_independence, error_feedback — raising the
:class:`Violation` of the first that fails. Each *distinct bug* — property, exception
type, the user-code line it arose at — raises its own exception class
(:func:`violation_class`), so Hypothesis keeps searching after the first failure and
shrinks each separately.

What a hook's own exception counts as: the step cannot complete, so *liveness* — except
when ``error_feedback`` is checked and the exception comes after step 0 (the memory kept
across steps broke it), then *error_feedback*. ``error_feedback`` is checked when the
hook's state :func:`keeps_residual`, or always when named in ``properties``. Errors of
simcluster's contract model (``CopyBackError``, bucket misuse, a backend rejecting an op)
count as *contract*.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from simcluster.checking import properties as P
from simcluster.checking.options import EF_DRAIN_CAP, EF_DRAIN_MAX, Options
from simcluster.checking.render import bucket_steps, error_text, rebuild_hint, user_line
from simcluster.checking.replay import DeferredToken
from simcluster.checking.report import PROPERTIES
from simcluster.checking.strategies import DTYPES, Example, ScheduleChoices
from simcluster.checking.supervisor import raise_site, watchdog_under
from simcluster.ddp.model import DDPConfig, SimDDP, gather_source, subgroups
from simcluster.engine.guard import is_stop_request
from simcluster.errors import (
    BackendRejection, CollectiveMismatchError, DeadlockError, GradBucketMisuse, HookContractError, HookExited,
    InFlightReadError, InFlightWriteError, NOT_THE_HOOKS, Violation, exit_meaning, first_line,
)
from simcluster.engine.matching import rank_list
from simcluster.engine.trace import Polled, Posted, ReadInFlight
from simcluster.fake.backends import backend_model
from simcluster.fake.cluster import SimCluster

__all__ = ["Violation", "violation_class", "run_example", "keeps_residual", "exit_head", "order_hint", "unreached_hint", "sources_hint",
           "with_posting_lines", "ORDER", "read_hint"]

ORDER = ("liveness", "contract", "replicas_agree", "averages", "keeps_nonfinite", "schedule_independence",
         "error_feedback")
"""The order the oracles are applied in (and distinct bugs are reported in)."""

Fail = Callable[..., None]
"""``fail(prop, message, error=None, **extra)``: raise the violation of ``prop`` (never returns)."""


# One subclass per property, so Hypothesis tells the failures apart and shrinks each.
VIOLATIONS: dict[str, type[Violation]] = {
    name: type(f"{''.join(w.title() for w in name.split('_'))}Violation", (Violation,), {"prop": name})
    for name in PROPERTIES
}
_KEYED: dict[tuple[str, str, str], type[Violation]] = {}


def violation_class(prop: str, error_type: str, line: str) -> type[Violation]:
    """The class raised for a distinct bug — (property, exception type, user-code line, or
    for a collective mismatch the calls that disagree).

    Hypothesis tells bugs apart by exception type and origin; every Violation is raised
    from one place, so the key must be in the type: one subclass per key (cached, so a
    key always gets the same class) lets Hypothesis shrink each distinct bug separately.
    """
    if not error_type:
        return VIOLATIONS[prop]
    key = (prop, error_type, line)
    if key not in _KEYED:
        base = VIOLATIONS[prop]
        _KEYED[key] = type(f"{base.__name__}[{error_type} at {line or '?'}]", (base,), {"key": key})
    return _KEYED[key]


# --------------------------------------------------------------------------- running
def groups_of(example: Example) -> list[list[int]]:
    """The ranks of each DDP group: the whole world, or its equal subgroups."""
    size = example.world_size // example.subgroups
    return [list(range(i * size, (i + 1) * size)) for i in range(example.subgroups)]


def simulate(opts: Options, example: Example, backend: str, schedule: Any,
             grads: list[list[list[torch.Tensor]]]) -> tuple[list[Any], BaseException | None, int, list[Any]]:
    """Run every step; (step results, the error that stopped the run or None, its step, the states)."""
    seed = opts.seed if example.rng_seed is None else example.rng_seed
    stuck = watchdog_under(opts.deadline) if opts.monitor.enabled else opts.deadline  # unsupervised: the only bound
    cluster = SimCluster(example.world_size, seed=seed, backend=backend, schedule=schedule, rng=opts.rng,
                         posting_lines=opts.posting_lines, launcher=opts.launcher, stuck_timeout=stuck)
    lay = example.layout
    config = DDPConfig(bucket_cap_mb=lay.bucket_cap_mb, static_graph=lay.static_graph,
                       find_unused_parameters=lay.find_unused_parameters,
                       gradient_as_bucket_view=lay.gradient_as_bucket_view, ready_order=lay.ready_order, api=opts.api)
    factory = subgroups(*groups_of(example)) if example.subgroups > 1 else None
    ddp = SimDDP(cluster, opts.hook, list(lay.shapes), state=opts.state, config=config,
                 dtype=DTYPES[example.dtype], process_group_factory=factory)
    if opts.monitor.enabled:
        ddp.on_hook_call = opts.monitor.at
    results: list[Any] = []
    for t, step_grads in enumerate(grads):
        try:
            results.append(ddp.step(step_grads))
        except NOT_THE_HOOKS:
            raise
        except BaseException as exc:  # the hook's failure is the finding (a BaseException of its own too)
            if is_stop_request(exc):
                raise
            return results, exc, t, ddp.states
    return results, None, len(grads), ddp.states


def keeps_residual(states: Sequence[Any]) -> bool:
    """Whether a hook state looks like error-feedback memory: an attribute whose name
    contains ``residual`` or ``error`` holding tensors (``TopKState.residuals``,
    PowerSGD's ``error_dict``). A heuristic; name the property to force the check."""
    return bool(residual_names(states))


def residual_names(states: Sequence[Any]) -> list[str]:
    """The attribute names that made :func:`keeps_residual` true (sorted, each once)."""
    found: set[str] = set()
    for state in states:
        names = list(getattr(state, "__dict__", {})) + list(getattr(type(state), "__slots__", ()))
        for name in names:
            if "residual" not in name.lower() and "error" not in name.lower():
                continue
            value = getattr(state, name, None)
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, torch.Tensor) for v in items):
                found.add(name)
    return sorted(found)


def run_example(opts: Options, example: Example, backend: str) -> None:
    """Run ``example`` and apply the oracles; raise the :class:`Violation` of the first that fails.

    Under a supervisor the example is announced first (its replay token), so an example
    that never ends is reported as itself."""
    if opts.monitor.enabled:
        opts.monitor.begin({"backend": backend, "token": DeferredToken(example, backend)})
    try:
        _judge_example(opts, example, backend)
    finally:
        opts.monitor.end()


# --------------------------------------------------------------------------- judging
def _inputs(opts: Options, example: Example) -> tuple[list[Any], int]:
    """The steps' gradients — with zero steps appended to drain a residual when
    *error_feedback* is checked — and the index of the first such drain step."""
    grads = example.grads()
    drain_from = len(grads)
    if "error_feedback" in opts.props:
        zero = [[[torch.zeros_like(t) for t in rank] for rank in grads[0]]]
        grads = grads + zero * opts.ef_drain
    return grads, drain_from


def _failer(info: dict[str, Any]) -> Fail:
    """The ``fail`` of one example: raises the violation class of the distinct bug, with ``info``."""
    def fail(prop: str, message: str, error: BaseException | None = None, **extra: Any) -> None:
        etype = type(error).__name__ if error is not None else ""
        line = user_line(error)
        identity = getattr(error, "simcluster_identity", None) or line  # a mismatch: its calls, not a side's line
        cls = violation_class(prop, etype, identity)
        raise cls(message, {**info, **extra, "error": error, "error_type": etype, "line": line, "identity": identity})
    return fail


def _judge_example(opts: Options, example: Example, backend: str) -> None:
    grads, drain_from = _inputs(opts, example)
    chooser = ScheduleChoices(example.schedule)
    results, error, at, states = simulate(opts, example, backend, chooser, grads)
    check_ef = "error_feedback" in opts.props and (opts.ef_forced or keeps_residual(states))
    taken = [pick for _, pick in chooser.taken]
    while taken and taken[-1] == 0:
        taken.pop()
    info: dict[str, Any] = {"example": example, "backend": backend, "schedule": taken, "step": at}
    fail = _failer(info)
    if error is not None:
        _judge_error(opts, error, at, check_ef, fail)
        return
    groups = groups_of(example)
    _judge_steps(opts, example, results, grads, drain_from, groups, info, fail)
    if "schedule_independence" in opts.props and taken:
        info["step"] = 0
        _judge_schedule(opts, example, backend, results, grads, taken, fail)
    if check_ef and not example.nonfinite:  # inputs holding inf/NaN have no finite mean for a lag to track
        msg = P.error_feedback([res.grads[0] for res in results], grads, drain_from=drain_from, ranks=groups[0],
                               carried=lambda: _carried(results))
        if msg and msg.startswith(P.NOT_DRAINED):  # the lag stayed: perhaps a top-1% hook, still sending
            longer = _drain_longer(opts, example, backend, grads[:drain_from], groups[0])
            msg = msg if longer == "" else longer
        if msg and msg.startswith(P.NOT_DRAINED):
            msg += _drain_cause(opts, example, backend, drain_from, states)
        if msg:
            fail("error_feedback", msg)


def _drain_cause(opts: Options, example: Example, backend: str, drain_from: int, states: Sequence[Any]) -> str:
    """What to add to an *error_feedback* failure whose lag did not drain: a bucket rebuild that
    put other parameters at the same positions (memory kept by bucket index now lands on them:
    the likely cause) — unless the lag stays as well when DDP never rebuilds
    (:func:`_drains_without_rebuild`: a residual keyed by shape, shared by two same-shaped
    parameters, was blamed on the rebuild, round 22 of hooks from the wild) — else, when the
    state's names chose the property, which names, and the ``--properties`` that leave it out
    (EF21's estimator does not promise what it checks)."""
    moved = rebuild_hint(bucket_steps(example, drain_from), drain_from)
    if moved and _drains_without_rebuild(opts, example, backend, drain_from) is False:
        return (f" (not DDP's bucket rebuild: the lag stays as well with buckets that never change "
                "(find_unused_parameters=True), so the hook's memory misses or reaches the wrong gradients whatever "
                "the buckets — memory shared by parameters that are not the same one, keyed by a shape, a size or a "
                "position?)")
    if moved:
        return (f" (likely cause: {moved} — memory a hook keys by what the rebuild changes is added to other "
                "parameters' gradients from then on, or never found again: a residual keyed by bucket.index() or "
                "by its position in the buffer lands on other parameters, one keyed by the bucket's tuple of "
                "parameters is orphaned; keep it per parameter, e.g. a dict from each parameter to its slice)")
    if opts.ef_forced:
        return ""
    others = ",".join(p for p in ORDER if p in opts.props and p != "error_feedback")
    return (f" (error_feedback is checked because the hook's state holds tensors named "
            f"{', '.join(residual_names(states))}; if the hook does not promise to send, over time, everything it "
            f"was given — EF21's estimator tracks the gradient, not its sum — check it without: --properties {others})")


def _drains_without_rebuild(opts: Options, example: Example, backend: str, drain_from: int) -> bool | None:
    """Whether the example's lag drains when DDP never rebuilds its buckets (the same layout
    under ``find_unused_parameters=True``, which applies the cap from iteration 0 and keeps
    it): True, False, or None when that run fails otherwise (the experiment says nothing)."""
    still = dataclasses.replace(example, layout=dataclasses.replace(example.layout, find_unused_parameters=True))
    grads, _ = _inputs(opts, still)
    try:
        results, error, _, _ = simulate(opts, still, backend, ScheduleChoices(example.schedule), grads)
    except Exception:  # noqa: BLE001 - an experiment: it says nothing
        return None
    if error is not None or len(results) < len(grads):
        return None
    msg = P.error_feedback([res.grads[0] for res in results], grads, drain_from=drain_from,
                           ranks=groups_of(still)[0], carried=lambda: _carried(results))
    return not (msg and msg.startswith(P.NOT_DRAINED))


def _drain_longer(opts: Options, example: Example, backend: str, steps: list[Any], group: list[int]) -> str | None:
    """*error_feedback* again with more zero steps, when the short drain left a lag: ``None``
    if it drains then.

    A hook that keeps its residual and sends at least one entry per bucket per step (top-k
    keeps ≥ 1) sends every entry within as many zero steps as the model has entries; a top-1%
    hook cannot within :data:`~simcluster.checking.options.DRAIN_STEPS`, nor a top-0.1% one
    (Deep Gradient Compression's ratio) on a 300-entry model within 256. So the drain runs
    :data:`EF_DRAIN_CAP` steps (fewer if the model has fewer entries), and while the lag is
    still there but shrinking (:func:`~simcluster.checking.properties.drain_progress`: less
    of it is left than when the zero steps began), again with as many steps as the rate so
    far needs (at least twice as many), up to the model's entries or :data:`EF_DRAIN_MAX`. A
    hook that sends nothing of its residual is judged on the first run: the lag it keeps
    does not shrink. Run only for an example that failed the short drain, so a hook that
    drains at once costs nothing more. ``''`` (no verdict) when the model has no more
    entries than the short drain had steps, or a longer run raised (the short run's report
    stands)."""
    entries = sum(math.prod(s) for s in example.layout.shapes)
    most = min(entries, EF_DRAIN_MAX)
    n = min(entries, EF_DRAIN_CAP)
    if n <= opts.ef_drain:
        return ""
    zero = [[[torch.zeros_like(t) for t in rank] for rank in steps[0]]]
    while True:
        grads = steps + zero * n
        results, error, _, _ = simulate(opts, example, backend, ScheduleChoices(example.schedule), grads)
        if error is not None:
            return ""
        outputs = [res.grads[0] for res in results]
        msg = P.error_feedback(outputs, grads, drain_from=len(steps), ranks=group, carried=lambda: _carried(results))
        if msg is None or n >= most:
            return msg
        began, left = P.drain_progress(outputs, grads, drain_from=len(steps), ranks=group)
        if not left < began * (1 - 1e-9):  # nothing of the residual was sent: more steps send nothing either
            return msg
        n = min(most, max(2 * n, math.ceil(1.25 * n * began / (began - left))))


def _carried(results: list[Any]) -> tuple[str, ...]:
    """The dtypes every step's collectives carried (each step's trace's ``dtypes()``), each once."""
    return tuple(dict.fromkeys(d for res in results for d in res.trace.dtypes()))


def _judge_steps(opts: Options, example: Example, results: list[Any], grads: list[Any], drain_from: int,
                 groups: list[list[int]], info: dict[str, Any], fail: Fail) -> None:
    """Step by step: every bucket's result (*contract*), then *replicas_agree*, *averages* and *keeps_nonfinite*."""
    for t, res in enumerate(results):
        info["step"] = t
        sizes = [sum(int(torch.Size(example.layout.shapes[i]).numel()) for i in b) for b in res.bucket_params]
        if "contract" in opts.props:
            for r, outs in enumerate(res.outputs):
                for k, value in enumerate(outs):
                    problem = P.result_problem(value, sizes[k], opts.api)
                    if problem:
                        source = gather_source(res.future_labels[r][k], backend_model(info["backend"]))
                        fail("contract", f"step {t}, rank {r}, bucket {k}: {problem}" + (f"\n({source})" if source else ""))
        for prop in ("replicas_agree", "averages", "keeps_nonfinite"):
            if prop not in opts.props or (prop == "averages" and t >= drain_from):
                continue
            if msg := _step_problem(opts, prop, res, grads[t], groups, example.nonfinite):
                extra = {"outcome": averages_outcome(opts, res.grads, grads[t], groups)} if prop == "averages" else {}
                fail(prop, f"step {t}{',' if prop == 'keeps_nonfinite' else ':'} {msg}", **extra)
            if prop == "replicas_agree" and res.params is not None and (msg := P.replicas_agree(res.params, groups)):
                fail(prop, f"step {t}: the parameters themselves differ: {msg}\n(the hook updated parameters in "
                     "place — an optimizer step inside the hook — and the replicas now hold different models; "
                     "step on the reduced gradients, in the callback, or leave the step to the training loop)")


def averages_outcome(opts: Options, results: Any, inputs: Any, groups: list[list[int]]) -> str:
    """What an *averages* failure is, for telling bugs apart: ``"another bucket's data"``
    when some parameter got another parameter's average
    (:func:`~simcluster.checking.properties.another_params_average`), else ``""``. Two
    failures of different outcomes are two bugs (``check._bug_key``): a shared compressor
    mixing buckets in flight, and the same hook's float16 sum of every rank at 65504 that
    overflows. (A hook that forgets to divide fails alike on both: one bug.)"""
    mixed = P.another_params_average(results, inputs, opts.tolerance, groups)
    return "" if mixed is None else "another bucket's data"


def _step_problem(opts: Options, prop: str, res: Any, inputs: Any, groups: list[list[int]],
                  nonfinite: bool) -> str | None:
    """What *replicas_agree*, *averages* or *keeps_nonfinite* finds wrong with one step's result
    (None: it holds). ``nonfinite``: whether the example puts an inf/NaN in some gradient
    (:attr:`Example.nonfinite`) — known from its spec, so a drawn example (never one) skips
    the oracles' look for one (a per-rank scan of every step: ~5% of the default run)."""
    if prop == "replicas_agree":
        return P.replicas_agree(res.grads, groups, inputs if nonfinite else None)
    if prop == "keeps_nonfinite":
        return P.keeps_nonfinite(res.grads, inputs, groups, res.bucket_params) if nonfinite else None
    return P.averages(res.grads, inputs, opts.tolerance, groups, res.bucket_params, res.trace.dtypes,
                      res.trace.wrapped)


def _judge_schedule(opts: Options, example: Example, backend: str, results: list[Any], grads: list[Any],
                    taken: list[int], fail: Fail) -> None:
    """*schedule_independence*: the same example completed in order must give the same gradients."""
    in_order, error_b, at_b, _ = simulate(opts, example, backend, "in_order", grads)
    if error_b is not None:
        fail("schedule_independence", f"in-order completion fails at step {at_b} where the drawn schedule "
             f"completes:\n{error_text(error_b)}", error_b, step=at_b)
    drawn, ordered = [r.grads for r in results], [r.grads for r in in_order]
    msg = P.schedule_independence(drawn, ordered, f"the schedule {taken}")
    if msg:  # the report's layout and gradients run up to the step where the two runs part
        step = P.first_parting(drawn, ordered)[0]  # type: ignore[index]
        polls = _late_polls(results[step].trace) if step < len(results) else ""
        fail("schedule_independence", msg + (f"\n({polls})" if polls else ""), step=step)


def repeat_hint(opts: Options, violation: Violation) -> str:
    """The reported failure's example run once more, as it was — its schedule and every
    property of the search, in their order, so its inputs too (*error_feedback* appends zero
    steps to drain a residual: a failure in one of those is reached only with it): ``''``
    when it fails the same way (property, error type, step, message) and two more runs of it
    give the same bits (:func:`_same_bits_twice`); else a line saying it did
    not — the hook's behaviour depends on something outside the example (a clock, OS
    entropy, thread timing, state kept in the process from an earlier run), so the verdict
    and its replay may not repeat, and no experiment that re-runs it (:func:`order_hint`,
    :func:`unreached_hint`, …) can be trusted: the caller then runs none. Up to three more
    simulations per reported failure."""
    info = violation.info
    try:
        _judge_example(opts, info["example"], info["backend"])
    except Violation as again:
        if (again.prop, again.info.get("error_type"), again.info.get("step")) != (
                violation.prop, info.get("error_type"), info.get("step")):
            outcome = f"failed {again.prop} at step {again.info.get('step')} instead"
        elif str(again) != str(violation):  # error_text masks what differs run to run (addresses)
            outcome = "failed the same way, but with another message"
        elif _same_bits_twice(opts, violation):
            return ""
        else:
            outcome = f"failed the same way, but two more runs of it gave other results at step {info.get('step', 0)}"
    except Exception:  # noqa: BLE001 - the re-run went another way (a usage error, say): nothing to say
        return ""
    else:
        outcome = "passed"
    return (f"\n(run once more, the same example {outcome}: what the hook does depends on something outside the "
            "example — a clock, OS entropy, thread timing, object identity (id() of an object made per call, "
            "reused as memory is: a dict keyed by id(bucket)), or state kept in the process from an earlier run (a "
            "module every rank shares, sys, builtins) — so this verdict and its replay may not repeat)")


def _same_bits_twice(opts: Options, violation: Violation) -> bool:
    """Whether two more runs of the reported failure's example, as it was, give every rank's
    results bit for bit alike at its failing step (:func:`_failing_step_again`'s run and one
    more). A simulation is deterministic: results that differ come from outside the example
    (a generator seeded from OS entropy draws other values each run), and a failure that
    repeats by chance — a coin the hook flips — would lend the experiments that follow its
    chance result (wild21: an entropy-seeded random-k hook got "with every rank's generators
    seeded alike the replicas agree" in 3 of 6 replays). A run that raises or stops short
    says nothing here (True)."""
    again = _failing_step_again(opts, violation)
    if again is None:
        return True
    example, backend, t, grads, step = again
    more, error, _, _ = simulate(opts, example, backend, ScheduleChoices(example.schedule), grads)
    if error is not None or len(more) <= t:
        return True
    return all(P.bits_equal(a, b) for mine, theirs in zip(step.grads, more[t].grads) for a, b in zip(mine, theirs))


VALUE_PROPERTIES = ORDER[ORDER.index("replicas_agree"):]
"""The properties a wrong value breaks (every one after *liveness* and *contract*: not a raise,
a hang or a broken contract)."""


def read_hint(opts: Options, violation: Violation) -> str:
    """For a reported wrong value: the first read of each tensor a collective still had in
    flight by a user line (``scale.max()`` before the MAX-reduce of ``scale`` was waited
    for), found by a re-run of the example that watches reads
    (:mod:`simcluster.fake.read_watch`); ``''`` if there was none. On gloo such a read is a
    race; the simulator gives the value from before the collective, so the report of the
    wrong value it leads to said nothing of why (a round of hooks written outside the
    project, 2026-12-07). One more simulation per reported failure, never in the search."""
    info = violation.info
    if violation.prop not in VALUE_PROPERTIES or info.get("error") is not None or opts.posting_lines:
        return ""
    example, backend = info["example"], info["backend"]
    grads, _ = _inputs(opts, example)
    try:
        results = simulate(dataclasses.replace(opts, posting_lines=True), example, backend,
                           ScheduleChoices(example.schedule), grads)[0]
    except Exception:  # noqa: BLE001 - an experiment: it says nothing
        return ""
    by_site: dict[tuple[str, str], list[ReadInFlight]] = {}  # one line of code, however many ranks and steps
    for result in results:
        for event in result.trace.of(ReadInFlight):
            by_site.setdefault((event.how, event.site), []).append(event)
    if not by_site:
        return ""
    said = []
    for (how, site), events in list(by_site.items())[:2]:
        first = events[0]
        ranks = sorted({e.rank for e in events})
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"
        doing = f" (first {first.doing})" if first.doing else ""
        said.append(f"{who} read memory {first.op}#{first.seq} on {first.group} still had in flight{doing}, "
                    f"with {how} at {site}")
    more = f" ({len(by_site) - 2} more lines)" if len(by_site) > 2 else ""
    return ("\n(likely cause: a read of memory in flight — " + "; ".join(said) + more + ". Until the collective "
            "completes, gloo's worker thread is writing that memory: a read sees the rank's own value or the reduced "
            "one, depending on timing, on NCCL whatever the kernel wrote so far; the simulator gives the value from "
            "before the collective. Read it after wait(), or in the future's callback)")


def order_hint(opts: Options, violation: Violation) -> str:
    """For a reported *replicas_agree* or *averages* failure found under a drawn schedule:
    if the same example passes that step with every collective completing in order, a line
    saying the result depends on completion order (else ``''``). Run once per reported
    failure, not during the search: one more simulation of the example."""
    info = violation.info
    if violation.prop not in ("replicas_agree", "averages") or not info.get("schedule") or info.get("error"):
        return ""
    example, backend, t = info["example"], info["backend"], info.get("step", 0)
    grads, _ = _inputs(opts, example)
    in_order = simulate(opts, example, backend, "in_order", grads)[0]
    if t >= len(in_order) or _step_problem(opts, violation.prop, in_order[t], grads[t], groups_of(example),
                                                   example.nonfinite):
        return ""
    drawn = _failing_step_again(opts, violation)
    polls = _late_polls(drawn[4].trace) if drawn is not None else ""
    if polls:
        return ("\n(with every collective completing in order and every first poll looking at once this step passes; "
                f"{polls})")
    return ("\n(with every collective completing in order this step passes — every rank calling the hook for all "
            "its buckets first: the result depends on the order in which collectives complete, and on whether their "
            "callbacks ran before a rank's next hook call — e.g. collectives posted from callbacks, which run in "
            "completion order, pair up differently on different ranks, or callbacks share state)")


def _late_polls(trace: Any) -> str:
    """The first polls of ``trace`` that looked only after the other ranks ran
    (:class:`~simcluster.engine.trace.Polled` choice 1), in words with why it matters, or ``''``."""
    late = [e for e in trace.of(Polled) if e.choice]
    if not late:
        return ""
    polls = "; ".join(f"rank {e.rank}'s of {e.future}{f' at {e.at}' if e.at else ''}" for e in late[:3])
    more = f" (and {len(late) - 3} more)" if len(late) > 3 else ""
    return (f"here a first poll looked only after the other ranks ran, and may have seen its work complete: {polls}"
            f"{more} — on real gloo a poll right after posting answers pending 86-100 % of the time: code that "
            "branches on the answer takes the other branch rarely, and not on every rank alike")


def unreached_hint(opts: Options, violation: Violation) -> str:
    """For a reported *replicas_agree* failure: when each rank's result at the failing step
    stays bit for bit the same however the other ranks' gradients at that step change, a
    line saying nothing the hook communicated reached its result (or, when the step's trace
    holds no collective, that the hook communicated nothing) — e.g. an all_reduce of a copy
    whose output is never used, or a future completed with the local buffer. Otherwise ``''``.

    It is an experiment, not a reading of the code: the example is run again up to that
    step as it was, then once per rank ``r`` and per change (every other rank's every
    element made 1 or 2, then -3 or -5, then a ramp 1, 2, 3, …: :data:`CHANGES`, each
    different from what was there), and ``r``'s result compared with the first run's. Any
    run that raises, or any result that moves, and nothing is said. Run once per reported
    failure, not during the search: 1 + 3W more simulations of the example up to the failing step."""
    if violation.prop != "replicas_agree" or violation.info.get("error"):
        return ""
    rerun = _failing_step_again(opts, violation)
    if rerun is None:
        return ""
    example, backend, t, grads, step = rerun
    for r in range(example.world_size):
        for change in CHANGES:
            run = _rerun_changed(opts, example, backend, grads, lambda q: q != r, change)
            if run is None or not all(P.bits_equal(a, b) for a, b in zip(run.grads[r], step.grads[r])):
                return ""
    collectives = step.trace.collectives()
    if not collectives:
        return (f"\n(the hook communicated nothing at step {t}: each rank's result is computed from its own gradients "
                "alone)")
    if example.world_size > 1 and all(len(c.ranks) == 1 for c in collectives):
        # every collective completed (the run raised nothing), each posted by a single rank:
        # each ran on a group of that rank alone (dist.new_group([r]), or groups built by a
        # rank-dependent list) — the communication reached nothing because there was nobody to reach
        c = collectives[0]
        return (f"\n(every collective of step {t} ran on a group of one rank — e.g. {c.op}#{c.seq} on {c.group}, "
                f"ranks {list(c.ranks)} alone: a reduction over one rank is that rank's own data. The group the hook "
                "passed (group=…) holds this rank only: check the ranks given to dist.new_group)")
    p_grad = ("" if example.layout.gradient_as_bucket_view else
              " (p.grad is one: with DDP's default gradient_as_bucket_view=False it is a tensor of its own, not a "
              "view of the bucket's buffer)")
    return (f"\n(nothing this hook communicated reached its result: each rank's result at step {t} stays bit for bit "
            "the same when the other ranks' gradients change — e.g. a collective on a copy whose output is never "
            f"used{p_grad}, or a future completed with the local buffer)")


def rounding_hint(opts: Options, violation: Violation) -> str:
    """For a reported *replicas_agree* failure at a step where every rank's result is a
    good average — the *averages* property holds there within float32's rounding of the
    float64 mean (``fp32``, or ``exact`` when asked; never under tolerance ``none``: a lossy
    tolerance such as ``norm=1.0`` passing says nothing of rounding, round 22 of hooks from the
    wild) — and something the hook communicated reached it (the caller asks
    :func:`unreached_hint` first) — a line saying the replicas differ by rounding
    alone: the ranks combined the same values in different orders or groupings (each rank
    adding its own part first: ``buggy.allgather_own_first``). Otherwise ``''``. One more
    simulation of the example up to the failing step, once per reported failure."""
    if violation.prop != "replicas_agree" or violation.info.get("error") or opts.tolerance == "none":
        return ""
    rerun = _failing_step_again(opts, violation)
    if rerun is None:
        return ""
    example, _, t, grads, step = rerun
    groups = groups_of(example)
    strict = opts if opts.tolerance == "exact" else dataclasses.replace(opts, tolerance="fp32")  # rounding, not loss
    if example.nonfinite or P.replicas_agree(step.grads, groups) is None \
            or _step_problem(strict, "averages", step, grads[t], groups, example.nonfinite) is not None:
        return ""
    factor = _apart_by_the_group_size(step.grads, groups)
    if factor:  # within the tolerance only by its absolute term (denormals): not rounding
        return (f"\n(where the replicas differ, one holds exactly {factor} times the other — the group size: a rank "
                "that skipped dividing by the world size, on some path only (a fast path, a branch on local data)? "
                "The averages property holds here only by its absolute term, the values being this small)")
    return ("\n(every rank's result is within the tolerance of the float64 mean — the averages property holds at "
            "this step — so the replicas differ by rounding alone: the ranks combined the same values in different "
            "orders or groupings, e.g. each adding its own part first, and float addition is not associative "
            "(in float32, (1 + 1e-08) - 1 is 0, (1 - 1) + 1e-08 is not); combine in one order on every rank — rank "
            "order, as all_reduce does — and the replicas stay bitwise equal)")


def _apart_by_the_group_size(results: list[list[torch.Tensor]], groups: list[list[int]]) -> int | None:
    """The group size ``W`` when, at every element where two ranks of a group differ, one
    holds exactly ``W`` times the other (one rank's sum against another's mean); else None.
    A difference by rounding is never such a ratio everywhere (a round of hooks written
    outside the project, 2026-12-07: a rank whose fast path forgot the division, on
    denormals, was told "the replicas differ by rounding alone")."""
    for ranks in groups:
        size, first = len(ranks), results[ranks[0]]
        found = False
        for r in ranks[1:]:
            for a, b in zip(first, results[r]):
                x, y = a.detach().to(torch.float64).reshape(-1), b.detach().to(torch.float64).reshape(-1)
                apart = x != y
                if not bool(apart.any()):
                    continue
                x, y = x[apart], y[apart]
                if not bool(((x == size * y) | (y == size * x)).all()):
                    return None
                found = True
        if found:
            return size
    return None


def rng_hint(opts: Options, violation: Violation) -> str:
    """For a reported *replicas_agree* failure under per-rank generators (each simulated
    rank's torch, Python ``random`` and numpy global generators seeded apart, as real ranks'
    are): when the same example, run again up to the failing step with every rank's
    generators seeded alike (``rng="same"``), gives replicas that agree there — a line
    saying each rank's result depends on its own random draws (``buggy.dp_noise_per_rank_rng``).
    Otherwise ``''``. One more simulation, once per reported failure."""
    if violation.prop != "replicas_agree" or violation.info.get("error") or opts.rng != "per_rank":
        return ""
    rerun = _failing_step_again(dataclasses.replace(opts, rng="same"), violation)
    if rerun is None or P.replicas_agree(rerun[4].grads, groups_of(rerun[0])) is not None:
        return ""
    return ("\n(with every rank's global generators seeded alike — torch's, Python's random, numpy's — the replicas "
            "agree at this step: each rank's result depends on its own random draws, and real ranks' generators "
            "differ (scripts seed them with seed + rank, or not at all); draw from a torch.Generator seeded the same "
            "on every rank, or let one rank draw and broadcast what it drew)")


def sources_hint(opts: Options, violation: Violation) -> str:
    """For a reported *averages* failure: when the results at the failing step are moved
    by some ranks' gradients only — every rank's result stays bit for bit the same however
    any other rank's gradients change — a line naming the ranks whose data reached them:
    one rank's is a broadcast from it (or a copy of its buffer) where an all_reduce of
    every rank's was meant. Otherwise (every rank's data reaches some result, none does,
    or a run raises) ``''``.

    An experiment, as :func:`unreached_hint`'s: the example is run again up to that step,
    then once per rank ``q`` and per change (``q``'s every element made 1 or 2, then -3 or
    -5, then a ramp: :data:`CHANGES`), and every rank's result compared with the first
    run's; ``q``'s data reached the results if any result moved. The numbers alone cannot
    say it: a shrunk example's rank 0 often holds zeros, which a hook zeroing its bucket
    returns too. Run once per reported failure: 1 + up to 3W more simulations of the
    example up to the failing step."""
    if violation.prop != "averages" or violation.info.get("error") or violation.info["example"].world_size < 2:
        return ""
    rerun = _failing_step_again(opts, violation)
    if rerun is None:
        return ""
    example, backend, t, grads, step = rerun
    world = example.world_size
    reached = []
    for q in range(world):
        for change in CHANGES:
            run = _rerun_changed(opts, example, backend, grads, lambda p: p == q, change)
            if run is None:
                return ""
            if not all(P.bits_equal(a, b) for r in range(world) for a, b in zip(run.grads[r], step.grads[r])):
                reached.append(q)
                break
    if not reached or len(reached) == world:
        return ""
    fact = ("every rank's result stays bit for bit the same when any other rank's gradients change — "
            + _why_one_source(step.trace, backend, reached))
    if len(reached) == 1:
        return f"\n(only rank {reached[0]}'s gradients reach the results at step {t}: {fact})"
    return f"\n(only ranks {', '.join(map(str, reached))}'s gradients reach the results at step {t}: {fact})"


def _why_one_source(trace: Any, backend: str, reached: list[int]) -> str:
    """The likely cause of :func:`sources_hint`'s finding, from what the step posted: a
    broadcast from the one rank reached; an all_gather under the NCCL model, whose future
    holds one stacked tensor where gloo's holds one tensor per rank (``buggy.allgather_assumes_gloo_list``);
    else the plain fact that the other ranks' data reached no result."""
    posted = [e for e in trace.events if isinstance(e, Posted)]
    if len(reached) == 1:
        s = reached[0]
        if any(e.op == "broadcast" and e.detail == f"root {s}" for e in posted):
            return f"a broadcast from rank {s} where an all_reduce of every rank's was meant"
        if backend == "nccl" and s == 0 and any(e.op == "all_gather" for e in posted):
            return ("an all_gather's future on NCCL holds one stacked tensor, [flat] of shape (world, …), where "
                    "gloo's holds one tensor per rank: a hook that averages fut.value() as gloo's list averages "
                    "that one tensor, and DDP keeps its first elements — rank 0's gradient. Read the output list "
                    "given to all_gather instead")
    return "the other ranks' data never entered a collective that reached a result"


def _failing_step_again(opts: Options, violation: Violation) -> tuple[Example, str, int, list[Any], Any] | None:
    """The reported failure's example run again, as it was, up to its failing step ``t``:
    ``(example, backend, t, the gradients of steps 0..t, step t's result)``, or None if the
    run raised or stopped short — the baseline :func:`unreached_hint` and :func:`sources_hint`
    compare their changed runs (:func:`_rerun_changed`) with, whose trace :func:`order_hint`
    reads. Simulated once per violation and generator mode (``violation.reruns``): the runs
    are deterministic, so every hint reads the same one."""
    if opts.rng in violation.reruns:
        return violation.reruns[opts.rng]  # type: ignore[no-any-return]
    info = violation.info
    example, backend, t = info["example"], info["backend"], info.get("step", 0)
    grads = _inputs(opts, example)[0][: t + 1]
    base, error, _, _ = simulate(opts, example, backend, ScheduleChoices(example.schedule), grads)
    again = None if error is not None or len(base) <= t else (example, backend, t, grads, base[t])
    violation.reruns[opts.rng] = again
    return again


def _rerun_changed(opts: Options, example: Example, backend: str, grads: list[Any],
                   changed: Callable[[int], bool], change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The example run again up to the last step of ``grads``, with that step's gradients of
    every rank ``q`` where ``changed(q)`` replaced by ``change`` of them: the run's last
    step, or None if the run raised or stopped short (:func:`unreached_hint`, :func:`sources_hint`)."""
    t = len(grads) - 1
    step = [[change(x) for x in rank] if changed(q) else rank for q, rank in enumerate(grads[t])]
    run, error, _, _ = simulate(opts, example, backend, ScheduleChoices(example.schedule), grads[:t] + [step])
    return None if error is not None or len(run) <= t else run[t]


def with_posting_lines(opts: Options, violation: Violation) -> Violation:
    """For a reported deadlock, collective mismatch or write to a tensor in flight: the same
    violation, found again by a re-run of the example that records the user line posting
    each collective (``SimCluster(posting_lines=True)``), so each call some rank never
    matched — a mismatch's first call, which may be the culprit; the call whose tensor a
    rank wrote to — is named with the line that posted it
    (``rank 0 posted it at hooks.py:12 in hook: …``). Otherwise ``violation`` itself.

    Finding a call's line walks the stack, which the search must not pay at every
    collective; so the search runs without, and this runs once per reported deadlock:
    one more simulation of the example up to the failing step. The re-run's violation is
    taken only if it is the same finding — same property, error type and step, and every
    line of the first report still there, in order — else (a hook whose state outlives a
    run, say: the re-run passes, or fails otherwise) the first report stands, without the lines."""
    info = violation.info
    if not isinstance(info.get("error"), (DeadlockError, CollectiveMismatchError, InFlightWriteError,
                                          InFlightReadError)) or opts.posting_lines:
        return violation
    try:
        _judge_example(dataclasses.replace(opts, posting_lines=True), info["example"], info["backend"])
    except Violation as again:
        same = (again.prop, again.info.get("error_type"), again.info.get("step")) == (
            violation.prop, info.get("error_type"), info.get("step"))
        if same and _keeps_lines(str(violation), str(again)):
            again.info = {**info, "error": again.info["error"]}  # the first run's printed output, schedule, line
            return again
    except Exception:  # noqa: BLE001 - the re-run went another way (a usage error, say): the first report stands
        pass
    return violation


def _keeps_lines(first: str, again: str) -> bool:
    """Whether every line of ``first`` is in ``again``, in the same order (``again`` may add lines)."""
    lines = iter(again.splitlines())
    return all(any(line == other for other in lines) for line in first.splitlines())


def _ones_or_twos(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every element changed: 2 where it was 1, else 1."""
    return torch.where(x == 1, 2, 1).to(x.dtype)


def _threes_or_fives(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every element changed, to negative values: -5 where it was -3, else -3."""
    return torch.where(x == -3, -5, -3).to(x.dtype)


def _ramp(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every element changed to a value that is not the same everywhere: 1, 2, 3,
    1, 2, 3, … (4, 5, 6 where ``x`` held that value). A hook may map every constant to the
    same message — one that sends each rank's gradients minus their mean, or clips at a
    multiple of their standard deviation (TernGrad) — so constant changes alone cannot
    show that a rank's data reaches the result (hooks from the wild, round 16)."""
    ramp = (torch.arange(x.numel()) % 3 + 1).reshape(x.shape).to(x.dtype)
    return torch.where(x == ramp, ramp + 3, ramp)


CHANGES = (_ones_or_twos, _threes_or_fives, _ramp)
"""How :func:`unreached_hint` and :func:`sources_hint` change a rank's gradients: two
constants of each sign and a ramp, each different from what was there at every element."""


def exit_head(error: BaseException, at: int) -> str | None:
    """How a hook that tried to end its process is described (None for other errors)."""
    meaning = exit_meaning(error, "the state factory" if _from_state_factory(error) else "the hook")
    if meaning is not None:
        return f"step {at}: {meaning}"
    if isinstance(error, HookExited):
        return f"step {at}: HookExited: {first_line(error)}"
    return None


def _from_state_factory(error: BaseException) -> bool:
    """Whether ``error`` escaped the hook's state factory (called in DDP's per-rank set-up)."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is SimDDP._init_rank.__code__:
            return tb.tb_next is not None
        tb = tb.tb_next
    return False


def _judge_error(opts: Options, error: BaseException, at: int, check_ef: bool, fail: Fail) -> None:
    """The property an exception that stopped the run breaks, and its full diagnostic."""
    text = error_text(error)
    head = f"step {at}: {text}"
    if (exit_text := exit_head(error, at)) is not None:
        fail("liveness", f"{exit_text}{raise_site(error)}", error)
    if "liveness" in opts.props and P.liveness(error):
        fail("liveness", head, error)
    if isinstance(error, (HookContractError, GradBucketMisuse, BackendRejection)):
        if "contract" in opts.props:
            fail("contract", head, error)
    elif _from_state_factory(error) and "liveness" in opts.props:
        fail("liveness", f"the state factory {opts.state_name} raised while DDP set up rank state at step {at} "
             f"(before any hook call; called once per rank with its process group):\n{text}", error)
    elif check_ef and at >= 1:
        fail("error_feedback", f"{head}\n(the hook's memory from earlier steps broke step {at})", error)
    # Whatever properties were chosen, a step that cannot complete was not checked: never a pass.
    fail("liveness", f"{head}\n(the hook raised: the step cannot complete on every rank)", error)
