"""``simcluster check --e2e``: after the simulated search, confirm on real DDP and real gloo.

For every checked row, :func:`e2e_for_rows` runs :func:`simcluster.real.e2e.run_e2e` on

* every shrunk counterexample the search reported (decoded from its replay token: world
  size, parameter shapes, bucket cap, DDP flags, the exact per-rank gradients, RNG seed and
  gradient-ready order, which real DDP follows as the simulation does);
* the edge case the search tries last: every rank at the value dtype's largest finite
  value (world 3 when it is among the world sizes);
* ``--e2e-examples`` scenarios drawn from ``--seed`` (world sizes among ``--world-sizes``
  up to 4, parameter shapes from ``--params`` or drawn, a cap or DDP's default).

Both sides load the check's ``--isolate`` modules per rank with the hook's (each simulated
rank its own copies, each real rank fresh ones per scenario: :func:`simcluster.real.e2e.per_process`),
so a hook keeping its state in a helper module is judged as the check judged it.

The real side is always gloo (these are CPU processes), so the simulator runs its gloo
model; a counterexample found under the NCCL model is replayed under the gloo model.
Examples that run DDP on subgroups are not run end to end (noted). Worlds are reused per
world size (:class:`~simcluster.real.gloo_runner.GlooCluster`) and all closed at the end.

A disagreement is a **fidelity bug of the simulator** (CLI exit 4), reported apart from the
hook's verdict; on a one-rank group, or for a simulated mismatch where real gloo finished, it is
*unconfirmed* (docs/e2e.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from simcluster.errors import SimulatorFidelityError
from simcluster.limits import E2E_TIMEOUT
from simcluster.real.e2e import E2EResult, Scenario, run_e2e, with_launcher

__all__ = ["E2ESummary", "SimulatorFidelityError", "confirm_report", "e2e_for_rows", "raise_fidelity",
           "scenarios_for_row", "scenario_from_example"]

MAX_DRAWN_WORLD = 4


@dataclass
class E2ESummary:
    """Every row's end-to-end results, by row name; ``notes`` by row name too."""

    results: dict[str, list[E2EResult]] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)

    @property
    def fidelity_bugs(self) -> list[E2EResult]:
        return [r for rs in self.results.values() for r in rs if r.verdict == "fidelity bug"]

    def failed_alike(self, name: str) -> list[E2EResult]:
        """Row ``name``'s scenarios in which the hook failed on both sides alike: its own failure,
        confirmed on real gloo — a failure of the row even when its search passed (the real
        reducer on simulated groups met an interleaving the search's DDP model did not draw:
        round 24 of hooks from the wild printed ``e2e ok 4`` and exit 0 over two such)."""
        return [r for r in self.results.get(name, []) if r.hook_failed]

    def missed_line(self, name: str) -> str:
        """For a row whose search passed: the line saying end to end found it failing, or ``''``."""
        failed = self.failed_alike(name)
        if not failed:
            return ""
        labels = ", ".join(r.scenario.label or r.scenario.describe() for r in failed)
        return (f"{name}: FAILED end to end — the search passed, but the hook failed alike on the simulator and on "
                f"real gloo in {len(failed)} of {len(self.results[name])} scenarios ({labels}): its failure, "
                "confirmed (shown above); the search did not draw what these scenarios met — more --examples may")

    def column(self, name: str) -> str:
        """The table cell: ``ok N``, ``FIDELITY k/N``, ``unsupported k/N`` (the hook used what
        the simulator does not model), ``failed alike k/N`` (the hook's failure, confirmed on
        real gloo), ``unconfirmed k/N`` or ``-``."""
        results = self.results.get(name, [])
        if not results:
            return "-"
        bugs = sum(r.verdict == "fidelity bug" for r in results)
        unsupported = sum(r.verdict == "unsupported" for r in results)
        unconfirmed = sum(r.verdict == "unconfirmed" for r in results)
        if bugs:
            return f"FIDELITY {bugs}/{len(results)}"
        if unsupported:
            return f"unsupported {unsupported}/{len(results)}"
        failed = len(self.failed_alike(name))
        if failed:
            return f"failed alike {failed}/{len(results)}"
        if unconfirmed:
            return f"unconfirmed {unconfirmed}/{len(results)}"
        return f"ok {len(results)}"

    def format(self) -> str:
        lines = ["end to end (real DDP on real gloo processes vs the simulator):"]
        for name, results in self.results.items():
            if not results and not self.notes.get(name):
                lines.append(f"  {name}: no scenario run")
            for note in self.notes.get(name, []):
                lines.append(f"  {name}: note: {note}")
            for result in results:
                if result.agree and not result.hook_failed:
                    how = " (gradients and parameters from the DDP model: the hook draws from torch's global RNG)" \
                        if result.sim.note else ""
                    lines.append(f"  {name}: agree — {result.scenario.describe()}{how}")
                else:
                    lines.append(_indent(result.format(per_step=False)))
        bugs = self.fidelity_bugs
        if bugs:
            lines.append(f"{len(bugs)} simulator fidelity bug(s): the simulation differs from real gloo (exit 4); "
                         "this is simcluster's bug, not the hook's — please report it")
        return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def scenario_from_example(example: Any, label: str) -> Scenario:
    """A check :class:`~simcluster.checking.strategies.Example` as a scenario: its exact
    gradients, and its layout's gradient-ready order (the order the simulated search's DDP
    step used, ``DDPConfig.ready_order``), which both sides then follow."""
    grads = example.grads()
    layout = example.layout
    return Scenario(world_size=example.world_size, shapes=tuple(tuple(s) for s in layout.shapes),
                    steps=example.steps, bucket_cap_mb=layout.bucket_cap_mb,
                    seed=0 if example.rng_seed is None else example.rng_seed, dtype=example.dtype,
                    static_graph=layout.static_graph, find_unused_parameters=layout.find_unused_parameters,
                    gradient_as_bucket_view=layout.gradient_as_bucket_view,
                    grads=tuple(tuple(tuple(rank) for rank in step) for step in grads), label=label,
                    ready_order=tuple(layout.ready_order) or None)


def _counterexamples(report: Any, notes: list[str]) -> list[Scenario]:
    from simcluster.checking.check import decode_example

    out, seen = [], set()
    for failure in report.failures:
        token = failure.details.get("token") if isinstance(failure.details, dict) else None
        if not token or token in seen:
            continue
        seen.add(token)
        example, backend = decode_example(token)
        if example.subgroups > 1:
            notes.append(f"the {failure.property} counterexample on {backend} runs DDP on subgroups: "
                         "not run end to end")
            continue
        label = f"counterexample: {failure.property} on {backend}"
        out.append(scenario_from_example(example, label + (" (replayed on the gloo model)" if backend != "gloo" else "")))
    return out


def _edge(row: dict[str, Any], options: dict[str, Any]) -> list[Scenario]:
    worlds = options["world_sizes"]
    if max(worlds) < 2 or row["tolerance"] not in ("fp32", "fp16", "bf16"):
        return []
    world = 3 if 3 in worlds else min(w for w in worlds if w >= 2)
    values = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(row["tolerance"], torch.float32)
    top = torch.finfo(values).max
    shapes = tuple(options.get("params") or ((4,),))
    steps = options["steps"]
    grads = tuple(tuple(tuple(torch.full(s, top, dtype=torch.float32) for s in shapes) for _ in range(world))
                  for _ in range(steps))
    return [Scenario(world, shapes, steps, None, options["seed"], grads=grads,
                     gradient_as_bucket_view=bool(options.get("gradient_as_bucket_view")),
                     label=f"edge: every rank at {str(values).removeprefix('torch.')} max")]


def _drawn(options: dict[str, Any], count: int) -> list[Scenario]:
    rng = random.Random(options["seed"])
    worlds = [w for w in options["world_sizes"] if w <= MAX_DRAWN_WORLD] or [min(options["world_sizes"])]
    out = []
    for n in range(count):
        shapes = tuple(options.get("params") or
                       tuple(tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 2))) for _ in range(rng.randint(1, 3))))
        numel = sum(torch.Size(s).numel() for s in shapes)
        cap = None if rng.random() < 0.5 else max(16, rng.randint(numel, 4 * numel)) / 2**20
        out.append(Scenario(rng.choice(worlds), shapes, options["steps"], cap, rng.randrange(2**31),
                            gradient_as_bucket_view=bool(options.get("gradient_as_bucket_view")),
                            label=f"drawn {n + 1}"))
    return out


def _not_run(row: dict[str, Any], report: Any) -> str | None:
    """Why a row is not run end to end (``None``: it is)."""
    if "trains_like_reference" in report.properties:
        return "a hook that steps an optimizer is checked on real DDP already (trains_like_reference); not run e2e"
    if row.get("backends") is not None and "gloo" not in row["backends"]:
        return f"checked under {', '.join(row['backends'])} only; the real processes here are gloo"
    if row.get("api") == "legacy":
        import torch

        return (f"checked as a torch 1.7-1.9 hook (--api legacy); the real processes run this machine's torch "
                f"{torch.__version__}, whose GradBucket has no 1.7-1.9 API; not run e2e")
    return None


def scenarios_for_row(row: dict[str, Any], report: Any, options: dict[str, Any],
                      count: int) -> tuple[list[Scenario], list[str]]:
    """The scenarios to run for one row (see the module docstring) and notes on those left out."""
    notes: list[str] = []
    return _counterexamples(report, notes) + _edge(row, options) + _drawn(options, count), notes


def e2e_for_rows(rows: Sequence[dict[str, Any]], reports: Sequence[Any], options: dict[str, Any], count: int,
                 progress: Any = None, *, timeout: float = E2E_TIMEOUT,
                 run: Callable[..., E2EResult] = run_e2e, start_method: str = "forkserver") -> E2ESummary:
    """Run every checked row's scenarios end to end; every gloo world is closed on return.

    ``start_method``: the gloo runner's (the default fork server needs the caller's
    ``__main__`` guarded, as the CLI's is; see :data:`simcluster.real.e2e_cli.START_METHOD`)."""
    from simcluster.limits import check_int
    from simcluster.real.gloo_runner import GlooCluster

    check_int("--e2e-examples", count, 0, 100)
    summary = E2ESummary()
    clusters: dict[int, GlooCluster] = {}
    try:
        for row, report in zip(rows, reports):
            if report.skipped is not None or row.get("skipped") is not None:
                continue
            why = _not_run(row, report)
            if why:
                summary.notes[row["name"]] = [why]
                summary.results[row["name"]] = []
                continue
            scenarios, notes = scenarios_for_row(row, report, options, count)
            summary.notes[row["name"]] = notes
            results = summary.results.setdefault(row["name"], [])
            for n, scenario in enumerate(scenarios, 1):
                if progress is not None and hasattr(progress, "set_prefix"):
                    progress.set_prefix(f"e2e {row['name']} [{n}/{len(scenarios)}] {scenario.label}")
                cluster = clusters.setdefault(scenario.world_size,
                                              GlooCluster(scenario.world_size, timeout=timeout, start_timeout=timeout,
                                                          start_method=start_method))
                scenario = with_launcher(scenario, options.get("launcher") or "none")
                results.append(run(scenario, row["target"], row["state"], backend="gloo", timeout=timeout,
                                   cluster=cluster, isolate=options.get("isolate") or ()))
    finally:
        for cluster in clusters.values():
            cluster.close()
    return summary


def confirm_report(report: Any, hook: Any, state: Any, options: dict[str, Any], count: int) -> E2ESummary:
    """The plugin's ``e2e=True``: run the report's row end to end; the summary goes to
    ``report.e2e`` and one ``e2e:`` note per disagreement to ``report.notes``.

    ``hook``/``state``: as given to the check (a ``module:name`` / ``file.py:name`` string, or
    an importable function); ``options``: the check's options (world sizes, steps, seed, params,
    tolerance, isolate, launcher; the check's defaults where missing).
    """
    from simcluster.real.differential import importable_name
    from simcluster.checking.tolerances import parse_tolerance
    from simcluster.usercode.rank_local import parse_isolate
    from simcluster.usercode.targets import parse_shapes

    target = hook if isinstance(hook, str) else importable_name(hook)
    state_spec = state if isinstance(state, str) else "none" if state is None else importable_name(state)
    params = options.get("params")
    tolerance = parse_tolerance(options.get("tolerance") or "fp32").describe()
    row = {"name": report.target, "target": target, "state": state_spec, "tolerance": tolerance, "skipped": None}
    opts = {"world_sizes": tuple(options.get("world_sizes") or (1, 2, 3, 4, 8)), "steps": options.get("steps", 3),
            "seed": options.get("seed") or 0,
            "params": parse_shapes(params, what="params") if isinstance(params, str) else params,
            "isolate": parse_isolate(options.get("isolate")), "launcher": options.get("launcher") or "none"}
    summary = e2e_for_rows([row], [report], opts, count)
    report.e2e = summary
    for result in summary.results.get(report.target, []):
        if not result.agree:
            report.notes.append(f"e2e: {result.verdict}: {result.scenario.describe()}: "
                                f"{'; '.join(result.differences) or result.why}")
    report.notes.append(f"e2e: {summary.column(report.target)}")
    return summary


def raise_fidelity(report: Any) -> None:
    """Raise :class:`SimulatorFidelityError` if ``report`` was confirmed end to end and disagreed;
    else ``AssertionError`` if its search passed but end to end the hook failed alike on both
    sides (:meth:`E2ESummary.failed_alike`)."""
    __tracebackhide__ = True  # pytest shows the test's line and the comparison
    summary = getattr(report, "e2e", None)
    if summary is None:
        return
    if summary.fidelity_bugs:
        raise SimulatorFidelityError(summary.format(), summary)
    if report.status != "FAILED" and summary.failed_alike(report.target):
        raise AssertionError(f"{summary.format()}\n{summary.missed_line(report.target)}")
