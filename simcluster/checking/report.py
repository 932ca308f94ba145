"""What a check finds, as plain data: the contract between the checker, the CLI and the plugin.

:func:`simcluster.checking.check.check_hook` returns a :class:`CheckReport`; ``simcluster check``
prints it (a table row per hook, then each failure in readable form) and ``--json``
writes ``CheckReport.to_dict()``; every ``assert_hook`` (the API's, the plugin's, the
``simcluster_assert`` fixture) ends in :meth:`CheckReport.assert_passed`, which raises
``AssertionError(report.format())`` when ``report.passed`` is false.

A :class:`PropertyFailure` carries everything needed to understand and reproduce a
failure: the property, the backend, the shrunk counterexample (world size, layout,
gradients, schedule) and a one-line replay command.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["PROPERTIES", "PropertyFailure", "CheckReport"]

PROPERTIES = ("averages", "replicas_agree", "contract", "liveness", "keeps_nonfinite", "schedule_independence",
              "error_feedback", "trains_like_reference")
"""Every oracle's name, as used in reports, options and the hooks catalogue."""


@dataclass
class PropertyFailure:
    """One property that failed, with its shrunk counterexample."""

    property: str  # one of PROPERTIES
    backend: str  # "gloo" | "nccl"
    message: str  # what went wrong, in words (the oracle's explanation)
    world_size: int
    layout: str  # readable: parameter shapes, cap, gradient-ready order, steps
    gradients: str  # readable: per-rank gradients (abridged when large)
    schedule: list[int]  # completion choices; [] = in-order
    replay: str  # one line: a shell command that reproduces this failure
    error_type: str = ""  # the exception class when the hook raised
    frames: list[str] = field(default_factory=list)  # the user-code frames it arose at, innermost last
    buckets: str = ""  # readable: each step's buckets (index → parameters), "(rebuilt)" where DDP rebuilt them
    hint: str = ""  # when the failing step ran on a rebuilt layout: what changed
    details: dict[str, Any] = field(default_factory=dict)  # machine-readable extras (token, line, ddp_steps, frames)
    output: str = ""  # what the code under test printed (stdout and stderr) in the reported run, clipped

    def format(self) -> str:
        """The failure in full: every line of the diagnostic, where, the DDP steps, how to replay.

        A failure found without running a step (``register_comm_hook`` refusing the hook:
        ``error_type == "registration"``) has no counterexample: its message and command only."""
        if self.error_type == "registration":
            return "\n".join([f"FAILED {self.property} [register_comm_hook, every backend]",
                              *(f"  {line}" for line in self.message.splitlines()),
                              f"  replay:    {self.replay}"])
        world = f", world size {self.world_size}" if self.world_size else ""  # 0: no example was running
        lines = [f"FAILED {self.property} [{self.backend}{world}]"]
        lines += [f"  {line}" if i == 0 else f"    {line}" for i, line in enumerate(self.message.splitlines())]
        lines += [f"  at {frame}" for frame in self.frames]
        lines.append(f"  layout:    {self.layout}")
        if self.buckets:
            lines.append(f"  buckets:   {self.buckets}")
        if self.hint:
            lines.append(f"  hint:      {self.hint}")
        lines += [
            f"  gradients: {self.gradients}",
            f"  schedule:  {self.schedule or 'in order'}",
        ]
        lines += _output_lines(self.output)
        lines.append(f"  replay:    {self.replay}")
        return "\n".join(lines)


def _output_lines(output: str) -> list[str]:
    """``output:`` and the printed lines under it, indented (none when nothing was printed)."""
    lines = output.splitlines()
    if not lines:
        return []
    return [f"  output:    {lines[0]}"] + [f"             {line}" for line in lines[1:]]


@dataclass
class CheckReport:
    """The result of checking one hook."""

    target: str  # "module:name" as given, or the hook's qualified name
    passed: bool
    properties: list[str]  # the properties checked
    backends: list[str]
    failures: list[PropertyFailure] = field(default_factory=list)
    skipped: str | None = None  # reason when the hook cannot be checked on CPU
    examples: int = 0  # Hypothesis examples run, over all backends
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # e.g. "legacy list result: rejected by current DDP"
    warnings: list[str] = field(default_factory=list)  # "file:line: Category: message", each once, as the hook raised them

    @property
    def status(self) -> str:
        if self.skipped is not None:
            return "skipped"
        return "ok" if self.passed else "FAILED"

    def format(self) -> str:
        head = f"{self.target}: {self.status}"
        if self.skipped is not None:
            return f"{head} ({self.skipped})"
        lines = [head + f" ({self.examples} examples; properties: {', '.join(self.properties)})"]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f.format() for f in self.failures]
        return "\n".join(lines)

    def assert_passed(self) -> None:
        """Raise ``AssertionError(self.format())`` unless every property held: the one
        assertion behind every ``assert_hook``. pytest hides this frame (and the
        plugin's), so a failing test shows the test's own line and the report, not this
        object's fields."""
        __tracebackhide__ = True
        if not self.passed:
            raise AssertionError(self.format())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status
        return data
