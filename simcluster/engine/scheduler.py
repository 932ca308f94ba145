"""Completion-order policies: which ready collective completes next.

A collective is *ready* once every participating rank has posted it (and, on the
gloo model, a worker thread of the group has picked it up on every rank). When
nothing else can run, the engine asks its scheduler to pick one ready collective
and completes it. That pick is the only nondeterminism a real cluster has that we
model, so it is a *choice*: an index into the ready list, which is ordered by the
moment each collective became ready. Choice ``0`` is always "the oldest ready
collective first" — the in-order schedule real runs mostly follow — so a
Hypothesis-drawn schedule shrinks towards it.

Every pick is recorded as ``(number_of_options, choice)``; replaying the list of
choices with :class:`ChoiceList` reproduces the run bit for bit::

    >>> from simcluster.engine.scheduler import SeededRandom, ChoiceList
    >>> s = SeededRandom(3)
    >>> picks = [s.choose(3) for _ in range(4)]
    >>> r = ChoiceList(picks)
    >>> [r.choose(3) for _ in range(4)] == picks
    True

Policies are small objects behind the :class:`Scheduler` protocol; one policy is
one class here.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from simcluster.errors import UsageError

__all__ = [
    "Scheduler",
    "InOrder",
    "Reverse",
    "SeededRandom",
    "ChoiceList",
    "DrawnChoices",
    "make_scheduler",
]


@runtime_checkable
class Scheduler(Protocol):
    """Picks which of ``n_ready`` ready collectives (oldest first) completes next."""

    def choose(self, n_ready: int) -> int:
        """Return an index in ``range(n_ready)``; ``n_ready`` is at least 1."""
        ...

    def describe(self) -> str:
        """A short, replayable description (``"in_order"``, ``"random(seed=3)"``, …)."""
        ...


class InOrder:
    """Always the oldest ready collective: the schedule a quiet real cluster follows."""

    def choose(self, n_ready: int) -> int:
        return 0

    def describe(self) -> str:
        return "in_order"


class Reverse:
    """Always the newest ready collective: the most adversarial fixed order."""

    def choose(self, n_ready: int) -> int:
        return n_ready - 1

    def describe(self) -> str:
        return "reverse"


class SeededRandom:
    """A uniformly random ready collective, from a private ``random.Random(seed)``.

    The global RNG is never touched, so the hook's own randomness and ours never mix.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._rng = random.Random(seed)
        self._bits = self._rng.getrandbits

    def choose(self, n_ready: int) -> int:
        # random.Random.randrange(n_ready)'s own algorithm (CPython 3.11: the smallest
        # k-bit draw below n, k = n.bit_length(), redrawn until it fits), written out:
        # the same choices for a seed, without randrange's two Python frames per choice
        # (one choice per rank-step in the gloo model), and owned here, so a schedule
        # does not change if a Python release changes randrange (its docs reserve that).
        if n_ready <= 1:
            return 0
        k = n_ready.bit_length()
        r = self._bits(k)
        while r >= n_ready:
            r = self._bits(k)
        return r

    def describe(self) -> str:
        return f"random(seed={self.seed})"


class ChoiceList:
    """Replays explicit choices; past the end of the list, or for an index that is
    out of range for the options at that point, it falls back to ``choice % n_ready``
    (so a shrunk list stays valid), and after the list runs out to in-order (``0``)."""

    def __init__(self, choices: Sequence[int]) -> None:
        bad = [c for c in choices if not isinstance(c, int) or isinstance(c, bool) or c < 0]
        if bad:
            raise UsageError(f"schedule choices must be non-negative ints, got {bad[0]!r} in {list(choices)!r}")
        self.choices = list(choices)
        self._next = 0

    def choose(self, n_ready: int) -> int:
        if self._next >= len(self.choices):
            return 0
        choice = self.choices[self._next] % n_ready
        self._next += 1
        return choice

    def describe(self) -> str:
        return f"choices{self.choices!r}"


class DrawnChoices:
    """Asks ``draw(n_ready)`` for each choice — Hypothesis draws them, so a failing
    schedule shrinks towards all-zero (in-order). Used by :mod:`simcluster.checking.strategies`."""

    def __init__(self, draw: Callable[[int], int]) -> None:
        self._draw = draw

    def choose(self, n_ready: int) -> int:
        return self._draw(n_ready) if n_ready > 1 else 0

    def describe(self) -> str:
        return "drawn"


def make_scheduler(schedule: object, seed: int) -> Scheduler:
    """Turn the user's ``schedule=`` argument into a fresh :class:`Scheduler`.

    ``"random"`` (the default; seeded by the cluster's seed), ``"in_order"``,
    ``"reverse"``, a list of ints (replayed by :class:`ChoiceList`), or any
    object with ``choose``/``describe``.
    """
    if schedule == "random":
        return SeededRandom(seed)
    if schedule == "in_order":
        return InOrder()
    if schedule == "reverse":
        return Reverse()
    if isinstance(schedule, (list, tuple)):
        return ChoiceList(schedule)
    if isinstance(schedule, Scheduler) and not isinstance(schedule, str):
        return schedule
    raise UsageError(
        f"schedule={schedule!r} (type={type(schedule).__name__}) is not a schedule: use "
        "'random', 'in_order', 'reverse', a list of choice indices, or a Scheduler"
    )
