"""The harness's mutation score: run the whole hook catalogue and count what is caught.

    python benchmarks/mutation_score.py [--examples 50] [--seed 0] [--only NAME,...] [--jobs 1]

Every entry of :mod:`simcluster.hooks.catalogue` is checked with :func:`simcluster.checking.check.check_hook`
the way ``simcluster check`` would check it by default — the CLI's default number of
examples (50 per backend), world sizes 1, 2, 3, 4, 8 (those below the entry's
``min_world_size`` dropped), 3 steps, seed 0, **every property that applies**, no example
database — under each backend the entry lists.

* A **buggy** entry counts as *caught* when its ``expected_failure`` property fails under
  every backend it lists.  A run with every property reports, per backend, only the first
  property an example breaks (liveness, contract, replicas_agree, averages, schedule,
  error feedback, in that order), so another property may reach a bug first — e.g. a
  hook whose callback raises on a size mismatch is charged to *liveness* before
  *averages* sees its wrong values.  When that happens the entry is checked again with
  its expected property **alone**; the table says so ("alone") rather than counting the
  other property's catch as the oracle's.
* A **correct** entry (reference and legacy reference hooks) counts when every property
  held on every backend.

Output: a markdown table (entry, bug class, expected property, caught by which properties
on which backends, seconds) and the score line
``N/M buggy hooks caught by their oracle, K/L correct hooks pass``.  Timing depends on
the machine and its load; the verdicts do not (fixed seed, no database).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from simcluster.hooks.catalogue import CatalogueEntry, entries
from simcluster.checking.check import check_hook
from simcluster.checking.report import CheckReport

DEFAULT_WORLD_SIZES = (1, 2, 3, 4, 8)
DEFAULT_EXAMPLES = 50  # simcluster check's --examples default

@dataclass
class Row:
    """The outcome for one catalogue entry."""

    entry: CatalogueEntry
    report: CheckReport
    alone: CheckReport | None = None  # the expected property checked by itself, when needed
    seconds: float = 0.0
    caught_on: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Caught by its oracle on every listed backend (buggy), or every property held (correct)."""
        if not self.entry.is_buggy:
            return self.report.passed
        return all(b in self.caught_on for b in self.entry.backends)


def world_sizes_for(entry: CatalogueEntry, sizes: Sequence[int] = DEFAULT_WORLD_SIZES) -> tuple[int, ...]:
    """The default world sizes the entry can run at (those >= its ``min_world_size``)."""
    chosen = tuple(w for w in sizes if w >= entry.min_world_size)
    return chosen or (max(entry.min_world_size, max(sizes)),)


def caught_backends(report: CheckReport, prop: str, backends: Sequence[str]) -> list[str]:
    """Backends on which ``prop`` failed; a registration failure (backend ``any``) counts for all."""
    hit = {f.backend for f in report.failures if f.property == prop}
    return [b for b in backends if b in hit or "any" in hit]


def run_entry(entry: CatalogueEntry, examples: int, seed: int) -> Row:
    """Check one entry with every property; re-check its expected property alone if it was masked."""
    start = time.monotonic()
    options = dict(target=entry.name, state=entry.state, tolerance=entry.tolerance, backends=entry.backends,
                   world_sizes=world_sizes_for(entry), examples=examples, seed=seed, api=entry.api)
    report = check_hook(entry.hook, **options)
    row = Row(entry, report)
    if entry.expected_failure is not None:
        row.caught_on = caught_backends(report, entry.expected_failure, entry.backends)
        if len(row.caught_on) < len(entry.backends):
            row.alone = check_hook(entry.hook, properties=[entry.expected_failure], **options)
            row.caught_on = caught_backends(row.alone, entry.expected_failure, entry.backends)
    row.seconds = time.monotonic() - start
    return row


def _found(report: CheckReport) -> str:
    by_prop: dict[str, list[str]] = {}
    for f in report.failures:
        by_prop.setdefault(f.property, []).append(f.backend)
    return "; ".join(f"{p} ({', '.join(sorted(set(b)))})" for p, b in by_prop.items()) or "—"


def bug_class(entry: CatalogueEntry) -> str:
    """The entry's bug class for the table ('correct' for a correct hook)."""
    if not entry.is_buggy:
        return "correct" + (" (legacy)" if entry.api == "legacy" else "")
    return entry.bug_class or "—"


def table(rows: Sequence[Row]) -> str:
    """The markdown table of the rows."""
    lines = ["| entry | bug class | expected | result | failed properties (backends) | s |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        e = row.entry
        if e.is_buggy:
            verdict = "caught" if row.ok else f"**missed** on {', '.join(b for b in e.backends if b not in row.caught_on)}"
            if row.ok and row.alone is not None:
                verdict += " (checked alone)"
        else:
            verdict = "passes" if row.ok else "**FAILS**"
        found = _found(row.report)
        if row.alone is not None:
            found += f"; alone: {_found(row.alone)}"
        lines.append(f"| `{e.name}` | {bug_class(e)} | {e.expected_failure or 'all hold'} | {verdict} | {found} "
                     f"| {row.seconds:.1f} |")
    return "\n".join(lines)


def score(rows: Sequence[Row]) -> str:
    """``N/M buggy hooks caught by their oracle, K/L correct hooks pass``."""
    buggy = [r for r in rows if r.entry.is_buggy]
    good = [r for r in rows if not r.entry.is_buggy]
    return (f"{sum(r.ok for r in buggy)}/{len(buggy)} buggy hooks caught by their oracle, "
            f"{sum(r.ok for r in good)}/{len(good)} correct hooks pass")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the catalogue, print the table and the score; exit 1 if anything is missed or fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated entry names")
    args = parser.parse_args(argv)
    wanted = [n for n in args.only.split(",") if n]
    chosen = [e for e in entries() if not wanted or e.name in wanted]
    rows = []
    start = time.monotonic()
    for i, entry in enumerate(chosen, 1):
        row = run_entry(entry, args.examples, args.seed)
        rows.append(row)
        print(f"[{i}/{len(chosen)}] {entry.name}: {'ok' if row.ok else 'NOT OK'} ({row.seconds:.1f}s)",
              file=sys.stderr, flush=True)
    total = time.monotonic() - start
    print(table(rows))
    print()
    print(f"**{score(rows)}** ({args.examples} examples per backend, seed {args.seed}, "
          f"world sizes {list(DEFAULT_WORLD_SIZES)} from each entry's minimum, 3 steps; {total:.0f} s in all)")
    print()
    print(f"Measured {datetime.date.today().isoformat()} on {platform.machine()} {platform.system()}, "
          f"{torch.get_num_threads()} torch threads, Python {platform.python_version()}, torch {torch.__version__}.")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
