"""Checking a :class:`~simcluster.checking.training.Training` with Hypothesis on real DDP (threads).

Each example is a :class:`TrainExample` — world size, the heads' sizes, a bucket cap, a
batch, an input seed — trained by :func:`simcluster.ddp.real_ddp.run_real_ddp` and judged by
:func:`simcluster.checking.training.trains_like_reference`; an exception or a hang is *liveness*.
A failure carries a replay token ``sct1.<base64url(JSON of the example and backend)>``
that :func:`check_training` (``replay=``) runs exactly once.
"""

from __future__ import annotations

import base64
import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, Verbosity, given, settings, strategies as st
from hypothesis import seed as hypothesis_seed

from simcluster.errors import SimClusterError, UsageError, Violation, first_line
from simcluster.ddp.real_ddp import run_real_ddp
from simcluster.limits import BACKEND_NAMES
from simcluster.checking.report import CheckReport, PropertyFailure
from simcluster.checking.training import Heads, Training, trains_like_reference

__all__ = ["TrainExample", "run_training", "check_training"]


@dataclass(frozen=True)
class TrainExample:
    """One drawn training job: world size, head sizes, bucket cap (bytes), batch, input seed."""

    world_size: int
    sizes: tuple[int, ...]
    cap_bytes: int
    batch: int
    seed: int

    def describe(self, iterations: int) -> str:
        return (f"model Heads({list(self.sizes)}) (Linear(n, 2) per head), cap {self.cap_bytes} B, batch {self.batch}, "
                f"{iterations} iterations")

    def inputs(self, iterations: int) -> list[list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        return [[torch.rand(self.batch, sum(self.sizes), generator=gen) * 2 - 1 for _ in range(iterations)]
                for _ in range(self.world_size)]

    def model(self) -> Heads:
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            return Heads(self.sizes)


TOKEN_PREFIX = "sct1."


def _token(example: TrainExample, backend: str) -> str:
    raw = json.dumps({"backend": backend, **example.__dict__, "sizes": list(example.sizes)}, sort_keys=True)
    return TOKEN_PREFIX + base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode(token: str) -> tuple[TrainExample, str]:
    try:
        body = token[len(TOKEN_PREFIX):]
        data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        backend = data.pop("backend")
        return TrainExample(**{**data, "sizes": tuple(data["sizes"])}), backend
    except Exception as exc:  # noqa: BLE001 - any malformation is the caller's
        raise UsageError(f"--replay {token[:40]!r}…: not a simcluster training replay token ({exc})") from None


_FAILS = {name: type(f"Training_{name}", (Violation,), {"prop": name}) for name in ("liveness", "trains_like_reference")}


def run_training(training: Training, example: TrainExample, backend: str, steps: int) -> None:
    """Train ``example`` with ``training`` and judge it; raises a :class:`~simcluster.errors.Violation` subclass on a violation."""
    iterations = training.warmup + steps
    inputs = example.inputs(iterations)
    try:
        run = run_real_ddp(example.model, inputs, world_size=example.world_size, hook=None, setup=training.setup,
                           iterations=iterations, bucket_cap_mb=example.cap_bytes / 2**20, backend=backend)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - the hook's (or the run's) failure is the finding
        kind = "" if isinstance(exc, SimClusterError) else " (the hook raised: the step cannot complete)"
        raise _FAILS["liveness"](f"{first_line(exc, typed=True)}{kind}") from None
    msg = trains_like_reference(run.params, run.initial[0], inputs, example.model(), warmup=training.warmup)
    if msg is not None:
        raise _FAILS["trains_like_reference"](msg)


def _examples(world_sizes: Sequence[int]) -> st.SearchStrategy[TrainExample]:
    @st.composite
    def build(draw: st.DrawFn) -> TrainExample:
        world = draw(st.sampled_from(sorted(set(world_sizes))))
        sizes = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        total = 4 * sum(3 * n + 2 for n in sizes)  # float32 bytes of the model: (n weights + 1 bias) x 2 outputs
        cap = max(8, total * draw(st.integers(1, 8)) // 8)
        return TrainExample(world, sizes, cap, draw(st.integers(1, 3)), draw(st.integers(0, 2**16)))

    return build()


def check_training(training: Training, *, target: str, backends: Sequence[str] = BACKEND_NAMES,
                   world_sizes: Sequence[int] = (1, 2, 3, 4, 8), steps: int = 3, examples: int = 50,
                   seed: int | None = 0, replay: str | None = None, **_ignored: Any) -> CheckReport:
    """Check a :class:`Training` on real DDP (threads) under each backend model it supports.

    ``examples`` is capped at 10 per backend (a real-DDP run costs ~0.1-1 s). Options of
    :func:`simcluster.checking.check.check_hook` that do not apply (state, tolerance, …) are ignored.
    """
    start = time.monotonic()
    chosen = [b for b in backends if b in training.backends]
    report = CheckReport(target=target, passed=True, properties=["liveness", "trains_like_reference"],
                         backends=chosen)
    if training.note:
        report.notes.append(training.note)
    if not chosen and replay is None:  # never a silent pass: say nothing was checked, and why
        report.skipped = f"runs under {', '.join(training.backends)} only" + (f": {training.note}" if training.note
                                                                              else "")
        return report
    with warnings.catch_warnings():  # restores the filters torch's rank threads swap concurrently
        warnings.showwarning = _without_functional_optim_warning(warnings.showwarning)
        if replay is not None:
            example, backend = _decode(replay)
            _run_one(training, example, backend, steps, report, target, seed)
        else:
            for backend in chosen:
                _search(training, backend, world_sizes, steps, min(examples, 10), seed, report, target)
    report.passed = not report.failures
    report.seconds = time.monotonic() - start
    return report


def _without_functional_optim_warning(show: Any) -> Any:
    """``showwarning`` minus torch's deprecation notice for functional optimizers, which ZeRO
    and ``_FunctionalSGD`` print on every construction under a forced ``"always"`` filter
    (so no filter can silence it): noise about torch's internals, not the hook under test."""
    def showwarning(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if "support for functional optimizers is deprecated" not in str(message):
            show(message, category, *args, **kwargs)

    return showwarning


def _run_one(training: Training, example: TrainExample, backend: str, steps: int, report: CheckReport, target: str,
             seed: int | None) -> None:
    report.examples += 1
    try:
        run_training(training, example, backend, steps)
    except Violation as failure:
        report.failures.append(_failure(failure, example, backend, steps, training.warmup, target, seed))


def _search(training: Training, backend: str, world_sizes: Sequence[int], steps: int, examples: int,
            seed: int | None, report: CheckReport, target: str) -> None:
    found: list[tuple[Violation, TrainExample]] = []

    def test(example: TrainExample) -> None:
        report.examples += 1
        try:
            run_training(training, example, backend, steps)
        except Violation as failure:
            found.append((failure, example))
            raise

    wrapped = given(_examples(world_sizes))(test)
    if seed is not None:
        wrapped = hypothesis_seed(seed)(wrapped)
    wrapped = settings(max_examples=examples, deadline=None, database=None, verbosity=Verbosity.quiet,
                       print_blob=False, report_multiple_bugs=False, suppress_health_check=list(HealthCheck))(wrapped)
    try:
        wrapped()
    except Violation as failure:
        example = next(ex for f, ex in reversed(found) if str(f) == str(failure) and f.prop == failure.prop)
        report.failures.append(_failure(failure, example, backend, steps, training.warmup, target, seed))


def _failure(failure: Violation, example: TrainExample, backend: str, steps: int, warmup: int, target: str,
             seed: int | None) -> PropertyFailure:
    iterations = steps + warmup
    token = _token(example, backend)
    replay = (f"simcluster check {target} --backend {backend} --world-sizes {example.world_size} "
              f"--steps {steps} --seed {0 if seed is None else seed} --replay {token}")
    return PropertyFailure(failure.prop, backend, str(failure), example.world_size, example.describe(iterations),
                           f"inputs: uniform(-1, 1) from seed {example.seed}", [], replay,
                           details={"token": token})
