"""``simcluster e2e`` under ``torchrun``: one process per rank, on one machine or many.

::

    torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m simcluster e2e TARGET [--params ...] [--steps K] [--seed S] [--backend gloo|nccl] [--isolate MOD]

Every rank joins the default group through env:// rendezvous (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` from torchrun), draws the same :class:`~simcluster.real.e2e.Scenario`
from the options and runs :func:`~simcluster.real.e2e.run_rank` (``--backend nccl``: on
``cuda:LOCAL_RANK``). Results travel through the rendezvous' key-value store, not the
process group — so they arrive even when the group is broken by a failed or hung rank.
Rank 0 gathers them, runs the simulation with the same world size and backend model and
judges the two sides as ``simcluster e2e`` does (:func:`~simcluster.real.e2e.judge_sides`),
prints the comparison and exits with the verdict's code (:mod:`simcluster.real.e2e_cli`).

Watchdog. Gloo's (NCCL's) own timeout is ``--timeout``; a rank whose run has not ended
``--timeout`` + 5 s after it started posts "hung" with its last event (a hook call or a
collective) from a watchdog thread. Rank 0 waits for every rank's post up to ``--timeout``
+ 15 s, so a hung rank is named in bounded time. Ranks leave with ``os._exit`` once rank 0
has posted the verdict (no process-group teardown at exit); when rank 0 exits non-zero,
torchrun itself stops every other rank (its ``ChildFailedError`` summary follows rank 0's
report). torchrun's own exit status is 0 or 1: the verdict is rank 0's printed report.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import sys
import threading
import time
import traceback
from typing import Any

from simcluster.errors import UsageError
from simcluster.fake.launcher import launcher_variables

__all__ = ["torchrun_main"]

_KEY = "simcluster-e2e"
_MARGIN = 5.0  # seconds after --timeout at which a rank declares itself hung
_GATHER_MARGIN = 15.0  # rank 0 waits this much beyond --timeout for every rank's post


class _Rank:
    """This process's rank: its store, its last event, and posting its outcome once."""

    def __init__(self, rank: int, world_size: int, store: Any) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.last = "started"
        self.posted = threading.Lock()
        self.done = False

    def emit(self, rank: int, text: str) -> None:
        # one write of the whole line: print() writes the text and its newline apart, and in an
        # unbuffered stdout two ranks' lines then interleave ("…bucket 0 (params [1, 0])simcluster-e2e rank 0: …")
        sys.stdout.write(f"simcluster-e2e rank {rank}: {text}\n")
        sys.stdout.flush()
        self.last = text
        try:
            self.store.set(f"{_KEY}/last/{rank}", text)
        except Exception:  # noqa: BLE001 - an event is best effort; the outcome post is not
            pass

    def post(self, outcome: dict[str, Any]) -> bool:
        """Post this rank's outcome (first caller wins: the main thread or the watchdog)."""
        if not self.posted.acquire(blocking=False):
            return False
        self.store.set(f"{_KEY}/result/{self.rank}", pickle.dumps(outcome))
        return True


def torchrun_main(args: argparse.Namespace) -> int:
    """One torchrun rank of ``simcluster e2e`` (see the module docstring). Never returns
    normally once the group is joined: the process leaves with ``os._exit``."""
    import torch
    import torch.distributed as dist

    from simcluster.real.e2e_cli import scenario_from_args
    from simcluster.usercode.rank_local import parse_isolate

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.world_size is not None and args.world_size != world_size:
        raise UsageError(f"--world-size {args.world_size} but torchrun started WORLD_SIZE={world_size} ranks")
    scenario = scenario_from_args(args, world_size)
    device = None
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            raise UsageError("--backend nccl: no CUDA device here; use --backend gloo")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, init_method="env://", timeout=datetime.timedelta(seconds=args.timeout))
    me = _Rank(rank, world_size, dist.distributed_c10d._get_default_store())
    payload = {"scenario": scenario, "hook": args.target, "state": args.state, "isolate": parse_isolate(args.isolate)}
    started = time.monotonic()
    threading.Thread(target=_watchdog, args=(me, args, scenario, started), daemon=True).start()
    try:
        outcome: dict[str, Any] = {"ok": run_rank_quietly(me, payload, device)}
    except BaseException as exc:  # noqa: BLE001 - reported through rank 0, never lost
        outcome = {"error": _error_outcome(me, exc)}
    outcome["seconds"] = time.monotonic() - started
    outcome["environ"] = launcher_variables(os.environ)
    if me.post(outcome):
        _finish(me, args, scenario, started)
    threading.Event().wait()  # the watchdog posted first: it finishes the run
    return 3  # pragma: no cover


def run_rank_quietly(me: _Rank, payload: dict[str, Any], device: Any) -> dict[str, Any]:
    from simcluster.real.e2e import run_rank

    return run_rank(me.rank, me.world_size, payload, device=device, emit=me.emit)


def _error_outcome(me: _Rank, exc: BaseException) -> dict[str, Any]:
    from simcluster.errors import first_line
    from simcluster.real.e2e import RAISED_NOTE, noted_step

    text = "".join(traceback.format_exception(exc))
    note = RAISED_NOTE.search(text)
    return {"type": type(exc).__name__, "message": first_line(exc), "traceback": text,
            "step": noted_step(note), "last": me.last}


def _watchdog(me: _Rank, args: argparse.Namespace, scenario: Any, started: float) -> None:
    """Post "hung" if this rank's run outlives ``--timeout`` + margin (its main thread is
    stuck, e.g. in a hook that never returns), with the main thread's stack."""
    time.sleep(args.timeout + _MARGIN)
    main = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001 - for the report
    stack = "".join(traceback.format_stack(main)) if main is not None else ""
    if me.post({"hung": {"last": me.last, "stack": stack}, "seconds": time.monotonic() - started,
                "environ": launcher_variables(os.environ)}):
        _finish(me, args, scenario, started)


def _finish(me: _Rank, args: argparse.Namespace, scenario: Any, started: float) -> None:
    """Rank 0: gather, simulate, compare, print, post the verdict and leave with its code
    (3 with the traceback on stderr when that broke: it left silently before).
    Others: wait for rank 0's verdict (bounded) and leave with 0."""
    if me.rank != 0:
        try:
            me.store.wait([f"{_KEY}/verdict"], datetime.timedelta(seconds=args.timeout + 2 * _GATHER_MARGIN + 120))
        except Exception:  # noqa: BLE001 - rank 0 is gone: torchrun stops us anyway
            _leave(3)
        _leave(0)
    from simcluster.cli import EXIT_INTERNAL, EXIT_INTERRUPTED

    code = EXIT_INTERNAL
    try:
        code = _report(me, args, scenario, started)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
        print("simcluster: interrupted", file=sys.stderr, flush=True)
    except BaseException:  # noqa: BLE001 - simcluster's own bug (exit 3): its traceback, as the CLI prints it
        print("simcluster: internal error on rank 0 while comparing the sides:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        try:
            me.store.set(f"{_KEY}/verdict", str(code))
        finally:
            _leave(code)


def _report(me: _Rank, args: argparse.Namespace, scenario: Any, started: float) -> int:
    """Rank 0's part: gather every rank's outcome into the real side, judge the simulator
    against it (:func:`~simcluster.real.e2e.judge_sides`, as ``simcluster e2e`` does), print
    the comparison; the exit code."""
    from simcluster.real.e2e import Side, judge_sides, note_failed_calls
    from simcluster.real.e2e_cli import exit_code
    from simcluster.usercode.rank_local import parse_isolate

    outcomes = _gather(me, args.timeout + _GATHER_MARGIN - (time.monotonic() - started) + _MARGIN)
    real = Side(f"real {args.backend} (torchrun)", seconds=max(o.get("seconds", 0.0) for o in outcomes.values()))
    real.raised = _raised(outcomes, me.world_size)
    real.failure = _real_failure(outcomes, me.world_size, real.raised)
    if real.failure is None:
        real.grads = [[outcomes[r]["ok"]["grads"][k] for r in range(me.world_size)] for k in range(scenario.steps)]
        real.params = [[outcomes[r]["ok"]["params"][k] for r in range(me.world_size)] for k in range(scenario.steps)]
    real.calls = {r: [tuple(c) for c in o["ok"]["calls"]] for r, o in outcomes.items() if "ok" in o}
    if real.failure is not None:
        note_failed_calls(real, {r: o["error"]["traceback"] for r, o in outcomes.items() if "error" in o})
    _quiet_the_group()
    scenario = with_rank_environs(scenario, outcomes)
    result = judge_sides(scenario, args.target, args.state, real, backend=args.backend, timeout=args.timeout,
                         isolate=parse_isolate(args.isolate))
    print(result.format(), flush=True)
    return exit_code(result)


def with_rank_environs(scenario: Any, outcomes: dict[int, dict[str, Any]]) -> Any:
    """``scenario`` carrying every real rank's launcher variables (``Scenario.environs``), so
    that the simulation's rank r sees real rank r's ``RANK``, ``LOCAL_RANK``, … rather than
    those of rank 0's process, where it runs; unchanged if a rank posted none (gone or stuck)."""
    import dataclasses

    environs = [outcomes[r].get("environ") for r in range(len(outcomes))]
    if any(env is None for env in environs):
        return scenario
    return dataclasses.replace(scenario, environs=tuple(tuple(sorted(env.items())) for env in environs))


def _quiet_the_group() -> None:
    """Rank 0, its real run over and every outcome gathered through the store: end its gloo
    group before the simulation forks its supervised child. A fork copies only the forking
    thread; gloo's background threads (and the at-fork handlers racing them) made one such
    child die of SIGSEGV before running any Python (seen once under load). Only from the main
    thread: when the watchdog finishes the run, the main thread may still be inside a
    collective of that group."""
    import torch.distributed as dist

    if threading.current_thread() is not threading.main_thread():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort: the simulation does not need the group
        pass


def _gather(me: _Rank, wait: float) -> dict[int, dict[str, Any]]:
    """Every rank's posted outcome; a rank that posted nothing in time is reported hung."""
    deadline = time.monotonic() + max(wait, 1.0)
    outcomes: dict[int, dict[str, Any]] = {}
    for r in range(me.world_size):
        key = f"{_KEY}/result/{r}"
        try:
            me.store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
            outcomes[r] = pickle.loads(me.store.get(key))
        except Exception:  # noqa: BLE001 - not posted in time: the rank (or its machine) is gone or stuck
            last = me.store.get(f"{_KEY}/last/{r}").decode() if me.store.check([f"{_KEY}/last/{r}"]) else "none"
            outcomes[r] = {"hung": {"last": last, "stack": "(no report from this rank: its process is stuck or gone)"}}
    return outcomes


def _real_failure(outcomes: dict[int, dict[str, Any]], world_size: int, own: dict[int, Any]) -> Any:
    """The real side's failure, if any: a hung rank first (the cause), then the first rank
    whose error is not a consequence of another's (``own``: :func:`_raised`)."""
    from simcluster.real.e2e import SideFailure

    hung = [r for r in range(world_size) if "hung" in outcomes[r]]
    if hung:
        lasts = "; ".join(f"rank {r}: last event {outcomes[r]['hung']['last']!r}" for r in hung)
        detail = "\n".join(f"--- rank {r} (stuck at) ---\n{outcomes[r]['hung']['stack']}" for r in hung)
        return SideFailure("hung", hung[0], "hung", f"ranks {hung} did not finish in time ({lasts})", None, detail)
    failed = [r for r in range(world_size) if "error" in outcomes[r]]
    if not failed:
        return None
    if own:
        return own[min(own)]
    e = outcomes[failed[0]]["error"]
    return SideFailure("raised", failed[0], e["type"], e["message"], e["step"], e["traceback"])


def _raised(outcomes: dict[int, dict[str, Any]], world_size: int) -> dict[int, Any]:
    """Every rank that raised an error of its own (not a consequence of another's: a peer's
    closed connection or, since a rank that raised stays in the world until rank 0's verdict,
    a timeout: :func:`~simcluster.real.gloo_runner.is_consequence` with ``timeouts``), as
    :class:`~simcluster.real.e2e.SideFailure`\\s by rank (:attr:`~simcluster.real.e2e.Side.raised`)."""
    from simcluster.real.e2e import SideFailure
    from simcluster.real.gloo_runner import is_consequence

    out = {}
    for r in range(world_size):
        e = outcomes[r].get("error")
        if e is not None and not is_consequence(e["traceback"], timeouts=True):
            out[r] = SideFailure("raised", r, e["type"], e["message"], e["step"], e["traceback"])
    return out


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
