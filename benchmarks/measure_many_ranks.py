"""Does real gloo's all_reduce at 130 and more ranks give the bits of simcluster's model? (docs/collectives.md §8)

    python benchmarks/measure_many_ranks.py [--worlds 130,200] [--ops SUM,PRODUCT,MAX,MIN] [--stagger]

What it measures. At many ranks and small chunks ``collectives.reduce(inputs, op, "gloo")``
folds the ring by whole-buffer steps (strided views, a flat index, or, for sums whose
chunks are at most 16 bytes, the "skewed" rows), layouts that only ever met real gloo at
worlds of 17 or fewer (benchmarks/measure_nan_payloads.py, with ``--skewed`` forcing the
skewed fold there). Here W real gloo processes all-reduce the same inputs, every rank
compares its result with the model's bits element by element, and one line per case says
which layout the model took and how many elements differ (summed over ranks; the first few
with both sides' bits when any do).

The sizes are picked per world so that each of the model's layouts is reached (see
:func:`sizes_for`): the largest size that is still gathered (65,536 elements over all
ranks), ``4·W − 6`` (float32 chunks of 4 elements, 16 bytes: the skewed fold for SUM,
reachable only above 128 ranks), 9,000 (chunks of tens of elements: whole-buffer steps) and
``2,100·W + 7`` (chunks over 2,048 elements: the per-chunk fold). Each size runs float16,
bfloat16 and float32 under every op; which fold the model took is recorded, not assumed
(:func:`model_result` watches which of collectives' fold functions ran).

The inputs (:func:`rank_inputs`) carry NaNs as measure_nan_payloads.py's do: on every third
element of every rank (``--stagger``: rank r's at ``r % 3, r % 3 + 3, …``), with a payload
that depends on the rank and the element (kept inside the quiet-NaN range: the older
script's ``nan + (rank + 1)·(e % 5 + 1)`` runs out of bfloat16's 6 payload bits at 13 ranks
and float16's 9 at 103, and its later "NaNs" are negative subnormals), here also with either
sign. Of the elements after those, every other one holds ±infinity or ±0 on about 1 rank in
50 (so ``inf − inf`` and ``inf · 0`` make new NaNs on the way) and the rest a lone NaN on one
rank; the element after that is a number on every rank. Numbers are ``±2^(0.3·z)``: near 1,
so a product of 256 of them neither overflows nor underflows and every step rounds.

Each line splits the differing elements by what met in them (:func:`element_classes`):
``numbers`` (no NaN in or made), ``one NaN`` (one NaN bit pattern, or one the op made) and
``NaNs meet`` (two or more different NaNs: which survives is §3's known limit). Without
``--stagger`` each class holds about a third of the elements; with it every element has
NaNs on about a third of the ranks, so all fall in ``NaNs meet`` (it is the run that shows
MAX and MIN with NaNs meeting numbers).

How. torch is imported once, in this process; the inputs and the model's results are worked
out here; then ``os.fork()`` starts the W ranks (copy-on-write: 256 processes fit where 256
spawned interpreters, each importing torch, would take minutes and gigabytes). They meet
through a ``TCPStore`` this process hosts, join a gloo group, run every case after a
barrier, compare with the model's bits they inherited, write a small JSON report into a
private ``tempfile.mkdtemp()`` directory and leave with ``os._exit``. Every rank dies with
this process (``PR_SET_PDEATHSIG``); past ``--timeout`` this process kills them all, and it
reaps every one on every path. A full mesh is W − 1 sockets a rank.

Measured (torch 2.13.0 CPU, 2 cores, worlds 130, 200 and 256, with and without
``--stagger``; figures in docs/collectives.md §8): ``numbers`` 0 differing in every case and
layout; ``one NaN`` 0 except float16 PRODUCT, where real gloo writes every NaN as
``0x7E00``/``0xFE00`` (payload dropped, sign kept: as for SUM) and the model keeps the payload
— at any world, 2 included; ``NaNs meet`` 0 for bfloat16, float32 SUM (skewed included), MAX
and MIN, not 0 for float16 SUM (the NaN's sign, near segment ends), float16 PRODUCT (the
payload) and float32 PRODUCT (gloo keeps the last NaN operand; the model the first where
torch's loop runs its scalar remainder: every element of 4-element chunks). A world takes 1.2
(130 ranks) to 5.2 minutes (256); at 256 ranks up to 8 GiB (PSS, this process and its ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import faulthandler
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from simcluster.fake import collectives

DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float16": (torch.float16, torch.int16),
    "bfloat16": (torch.bfloat16, torch.int16),
    "float32": (torch.float32, torch.int32),
}
QUIET_NAN = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000}
PAYLOAD_BITS = {torch.float16: 9, torch.bfloat16: 6, torch.float32: 22}
SIGN_BIT = {torch.float16: -0x8000, torch.bfloat16: -0x8000, torch.float32: -0x80000000}
_AS_INT = {2: torch.int16, 4: torch.int32}
SHOWN = 4
"""Differing elements shown per case (with both sides' bits)."""


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One all_reduce: ``n`` elements of ``dtype`` on every rank, reduced with ``op``."""

    n: int
    dtype: str
    op: str

    @property
    def key(self) -> str:
        return f"{self.n}/{self.dtype}/{self.op}"


def sizes_for(world: int) -> list[int]:
    """Sizes that reach each of the model's fold layouts at ``world`` ranks (128 < world):
    gathered, skewed (float32 SUM: chunks of 4 elements), whole-buffer steps, per chunk."""
    return [65536 // world, 4 * world - 6, 9000, 2100 * world + 7]


def rank_inputs(world: int, n: int, dtype: torch.dtype, stagger: bool) -> torch.Tensor:
    """Row r: rank r's input (the module docstring says what it holds)."""
    gen = torch.Generator().manual_seed(world * 1_000_003 + n)
    sign = torch.where(torch.rand(world, n, generator=gen) < 0.5, -1.0, 1.0).double()
    x = (sign * torch.exp2(0.3 * torch.randn(world, n, generator=gen, dtype=torch.float64))).to(dtype)
    special = torch.rand(world, n, generator=gen)
    ranks = torch.arange(world).unsqueeze(1)
    elements = torch.arange(n).unsqueeze(0)
    phase = (elements - (ranks % 3 if stagger else 0)) % 3  # 0: a NaN, 1: see below, 2: a number
    specials = (phase == 1) & ((elements // 3) % 2 == 0)
    x[specials & (special < 0.005)] = float("inf")
    x[specials & (special >= 0.005) & (special < 0.01)] = -float("inf")
    x[specials & (special >= 0.01) & (special < 0.015)] = 0.0
    x[specials & (special >= 0.015) & (special < 0.02)] = -0.0
    lone = (phase == 1) & ((elements // 3) % 2 == 1) & (ranks == (elements // 6) % world)
    payload = ((ranks + 1) * (elements % 5 + 1)) % (1 << PAYLOAD_BITS[dtype])
    negative = (ranks + elements // 3) % 2 == 1
    nan_bits = QUIET_NAN[dtype] + payload + torch.where(negative, SIGN_BIT[dtype], 0)
    bits = x.view(DTYPES[str(dtype).removeprefix("torch.")][1])
    bits.copy_(torch.where((phase == 0) | lone, nan_bits.to(bits.dtype), bits))
    return x


CLASSES = ("numbers", "one NaN", "NaNs meet")


def element_classes(inputs: torch.Tensor, op: str) -> torch.Tensor:
    """Per element, an index into :data:`CLASSES`: no NaN among its operands and none made on
    the way; one NaN (one bit pattern, or one the op makes of ``inf − inf`` / ``inf · 0``);
    two or more different NaNs meet — where §3's known limit lies (which one survives
    depends on where the element falls in the kernels' vector body or scalar tail)."""
    bits = inputs.view(_AS_INT[inputs.element_size()])
    nan = inputs.isnan()
    info = torch.iinfo(bits.dtype)
    any_nan = nan.any(0)
    several = any_nan & (torch.where(nan, bits, info.min).amax(0) != torch.where(nan, bits, info.max).amin(0))
    if op == "SUM":
        made = (inputs == float("inf")).any(0) & (inputs == -float("inf")).any(0)
    elif op == "PRODUCT":
        made = inputs.isinf().any(0) & (inputs == 0).any(0)
    else:
        made = torch.zeros_like(any_nan)
    meet = several | (any_nan & made)
    one = (any_nan | made) & ~meet
    return one.to(torch.int8) + 2 * meet.to(torch.int8)



@contextlib.contextmanager
def recording_layouts(seen: list[str]) -> Iterator[None]:
    """While open, each of collectives' fold functions appends its layout's name to ``seen``
    when it runs (``_gloo_ring`` and ``_fold_by_step`` look them up as module globals)."""
    names = {"_fold_gathered": "gathered", "_fold_per_chunk": "per-chunk", "_fold_by_step": "by-step",
             "_fold_by_strides": "strided", "_fold_skewed": "skewed"}
    originals = {name: getattr(collectives, name) for name in names}

    def recorder(name: str) -> Callable[..., torch.Tensor]:
        def fold(*args: Any, **kwargs: Any) -> torch.Tensor:
            seen.append(names[name])
            return originals[name](*args, **kwargs)
        return fold

    try:
        for name in names:
            setattr(collectives, name, recorder(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(collectives, name, fn)


def layout_name(seen: list[str]) -> str:
    """``by-step`` alone (no strided or skewed inside it) is the flat-index fold."""
    if seen[:1] == ["by-step"]:
        return "by-step/" + (seen[1] if len(seen) > 1 else "index")
    return "/".join(seen) or "none"


def model_result(inputs: torch.Tensor, case: Case) -> tuple[torch.Tensor, str, float]:
    """The model's bits for ``case``, the layout it folded with, and the seconds it took."""
    seen: list[str] = []
    rows = list(inputs.unbind(0))
    start = time.perf_counter()
    with recording_layouts(seen):
        out = collectives.reduce(rows, case.op, "gloo")
    seconds = time.perf_counter() - start
    return out.view(DTYPES[case.dtype][1]).clone(), layout_name(seen), seconds


# --------------------------------------------------------------------------- one rank
def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # the parent was gone before the prctl
        os._exit(3)


def compare(got: torch.Tensor, want: torch.Tensor, classes: torch.Tensor) -> dict[str, Any]:
    """Differing elements of two bit tensors, by class (:func:`element_classes`): the counts
    and each class's first few ``[index, got, want]``; and a digest of ``got``."""
    wrong = (got != want).nonzero().flatten()
    mask = (1 << (8 * got.element_size())) - 1
    of_wrong = classes[wrong]
    shown = [[[i, int(got[i]) & mask, int(want[i]) & mask] for i in wrong[of_wrong == k][:SHOWN].tolist()]
             for k in range(len(CLASSES))]
    return {"differing": torch.bincount(of_wrong.long(), minlength=len(CLASSES)).tolist(), "shown": shown,
            "digest": hashlib.sha1(got.numpy().tobytes()).hexdigest()[:16]}


def run_rank(rank: int, world: int, port: int, timeout: float, cases: list[Case],
             inputs: dict[tuple[int, str], torch.Tensor], wants: dict[str, tuple[torch.Tensor, torch.Tensor]],
             out_dir: str) -> None:
    """One real gloo rank: join, all_reduce every case, compare with the model, write the report."""
    torch.set_num_threads(1)
    started = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    report: dict[str, Any] = {"join_seconds": time.perf_counter() - started, "cases": {}}
    for case in cases:
        bits_dtype = DTYPES[case.dtype][1]
        x = inputs[(case.n, case.dtype)][rank].clone()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, case.op))
        seconds = time.perf_counter() - start
        report["cases"][case.key] = {**compare(x.view(bits_dtype), *wants[case.key]), "seconds": seconds}
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(path + ".tmp", path)
    dist.barrier()  # no rank closes its sockets while a peer still reads from them


def child(rank: int, parent: int, job: Callable[[int], None], out_dir: str, timeout: float) -> None:
    """The forked process: never returns; a failure leaves its traceback in ``rank<r>.err``,
    and a rank still running shortly before the parent's ``timeout`` its stack in ``rank<r>.stack``."""
    code = 1
    try:
        die_with_parent(parent)
        stack = open(os.path.join(out_dir, f"rank{rank}.stack"), "w")
        faulthandler.dump_traceback_later(max(timeout - 5.0, timeout * 0.8), file=stack)
        job(rank)
        code = 0
    except BaseException:  # noqa: BLE001 - reported by the parent
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        os._exit(code)


# --------------------------------------------------------------------------- the parent
def used_mib() -> int:
    """Memory in use on the machine (MemTotal − MemAvailable), MiB."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) // 1024


def pss_mib(pids: list[int]) -> int:
    """The processes' proportional set size, summed, MiB: each page shared by k of them
    counts 1/k to each, so copy-on-write pages are counted once (other users of the
    machine, which ``used_mib`` includes, are not)."""
    total_kib = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
            total_kib += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return total_kib // 1024


@dataclass
class Reaped:
    """How a world's ranks ended: exit status by pid, peak memory of this process and its
    ranks (PSS, MiB) and of the machine (in use, MiB)."""

    statuses: dict[int, int]
    peak_pss: int = 0
    peak_used: int = 0


def fork_ranks(world: int, job: Callable[[int], None], out_dir: str, timeout: float, pids: list[int]) -> None:
    """Fork ``world`` processes, rank r running ``job(r)``; each pid is appended to ``pids``
    as soon as it exists (so that :func:`end_all` finds it if a later fork fails)."""
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            child(rank, parent, job, out_dir, timeout)
        pids.append(pid)


def reap(pids: list[int], timeout: float, reaped: Reaped) -> None:
    """Wait for every pid, sampling memory every 2 s; :class:`TimeoutError` past ``timeout`` s."""
    pending = set(pids) - set(reaped.statuses)
    deadline = time.monotonic() + timeout
    next_sample = 0.0
    while pending:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{len(pending)} of {len(pids)} ranks still running after {timeout:.0f} s; killed")
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pending:
            pending.discard(pid)
            reaped.statuses[pid] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() >= next_sample:
            reaped.peak_pss = max(reaped.peak_pss, pss_mib([os.getpid(), *pending]))
            reaped.peak_used = max(reaped.peak_used, used_mib())
            next_sample = time.monotonic() + 2.0
        else:
            time.sleep(0.1)


def end_all(pids: list[int], reaped: Reaped) -> None:
    """Kill every pid not reaped yet, then reap it: no rank outlives a world, whatever happened."""
    left = [pid for pid in pids if pid not in reaped.statuses]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in left:
        reaped.statuses[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def listening_socket(backlog: int) -> socket.socket:
    """A socket listening on a free port of 127.0.0.1, for the ranks' store to serve on."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(backlog)
    return listener


@contextlib.contextmanager
def served_store(listener: socket.socket, timeout: float) -> Iterator[dist.TCPStore]:
    """The ranks' rendezvous: a ``TCPStore`` served by this process on ``listener``.

    Started only once every rank is forked: its server thread must not exist at a fork (a
    rank forked while that thread held a lock waited forever in its own ``TCPStore``; seen
    in 5 of 20 runs at 8 ranks when the store was started first, in none of 20 since).
    Deleting it at the end
    stops the thread before the next world forks."""
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False, master_listen_fd=listener.detach())  # the store closes it
    try:
        yield store
    finally:
        del store


def measure_world(world: int, ops: list[str], stagger: bool, timeout: float) -> None:
    """Every case at ``world`` ranks: the model here, the real ranks forked, one line per case."""
    begun = time.perf_counter()
    cases = [Case(n, dtype, op) for n in sizes_for(world) for dtype in DTYPES for op in ops]
    inputs = {(n, name): rank_inputs(world, n, dtype, stagger)
              for n in sizes_for(world) for name, (dtype, _) in DTYPES.items()}
    models = {case.key: model_result(inputs[(case.n, case.dtype)], case) for case in cases}
    wants = {case.key: (models[case.key][0], element_classes(inputs[(case.n, case.dtype)], case.op))
             for case in cases}
    prepared = time.perf_counter() - begun
    listener = listening_socket(backlog=world + 64)
    port = listener.getsockname()[1]
    out_dir = tempfile.mkdtemp(prefix=f"many_ranks_{world}_")
    try:
        def job(rank: int) -> None:
            run_rank(rank, world, port, timeout, cases, inputs, wants, out_dir)

        real_start = time.perf_counter()
        pids: list[int] = []
        reaped = Reaped({}, pss_mib([os.getpid()]), used_mib())
        try:
            fork_ranks(world, job, out_dir, timeout, pids)
            with served_store(listener, timeout):
                reap(pids, timeout, reaped)
        except TimeoutError as exc:
            end_all(pids, reaped)  # killed first, then what they left is read
            raise TimeoutError(f"world {world}: {exc}. What they were doing:\n{stacks(out_dir)}") from None
        finally:
            end_all(pids, reaped)
        real_seconds = time.perf_counter() - real_start
        reports = read_reports(world, out_dir, reaped.statuses)
    finally:
        listener.close()  # a no-op once the store took it
        shutil.rmtree(out_dir, ignore_errors=True)
    join = max(r["join_seconds"] for r in reports)
    print(f"world {world}: inputs and model {prepared:.1f} s; {world} gloo ranks forked, joined in {join:.1f} s, "
          f"all cases and exit {real_seconds:.1f} s; memory at most {reaped.peak_pss} MiB (PSS of this process and "
          f"its ranks), {reaped.peak_used} MiB in use on the machine", flush=True)
    for case in cases:
        sizes = torch.bincount(wants[case.key][1].long(), minlength=len(CLASSES)).tolist()
        print_case(world, case, models[case.key][1:], sizes, [r["cases"][case.key] for r in reports])


def stacks(out_dir: str) -> str:
    """The Python stacks the ranks left (``rank<r>.stack``), each distinct one once, with its ranks."""
    by_stack: dict[str, list[int]] = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".stack"):
            with open(os.path.join(out_dir, name)) as f:
                by_stack.setdefault(f.read().strip(), []).append(int(name[4:-6]))
    return "\n".join(f"ranks {sorted(ranks)}:\n{text}" for text, ranks in by_stack.items() if text) or "(no stacks)"


def read_reports(world: int, out_dir: str, statuses: dict[int, int]) -> list[dict[str, Any]]:
    """Every rank's report, rank order; raises with the first failed rank's traceback."""
    reports = []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            err = os.path.join(out_dir, f"rank{rank}.err")
            text = open(err).read() if os.path.exists(err) else "(no report, no traceback)"
            codes = sorted(set(statuses.values()))
            raise RuntimeError(f"world {world}: rank {rank} reported nothing (exit codes seen: {codes}):\n{text}")
        with open(path) as f:
            reports.append(json.load(f))
    return reports


def print_case(world: int, case: Case, model: tuple[str, float], sizes: list[int],
               per_rank: list[dict[str, Any]]) -> None:
    """One line: the case, the model's layout, differing elements (summed over the ranks) of
    each class out of the class's elements (per rank), both sides' times; then the first
    differing elements of each class with both sides' bits (from the first rank showing them)."""
    layout, model_seconds = model
    differing = [sum(r["differing"][k] for r in per_rank) for k in range(len(CLASSES))]
    digests = {r["digest"] for r in per_rank}
    real_seconds = max(r["seconds"] for r in per_rank)
    counts = ", ".join(f"{name} {d}/{size}" for name, d, size in zip(CLASSES, differing, sizes))
    agree = "" if len(digests) == 1 else f" ({len(digests)} different results over the ranks)"
    print(f"world {world} {case.n:>7} {case.dtype:>8} {case.op:<7} {layout:<15} {sum(differing):>7} differing "
          f"({counts}){agree}; gloo {real_seconds:.3f} s, model {model_seconds:.3f} s", flush=True)
    for k, name in enumerate(CLASSES):
        rank = next((rank for rank, r in enumerate(per_rank) if r["shown"][k]), None)
        if rank is not None:
            pairs = ", ".join(f"[{i}] {g:#x} (model {w:#x})" for i, g, w in per_rank[rank]["shown"][k])
            print(f"    {name}, rank {rank}: gloo {pairs}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="130,200", help="comma-separated world sizes (above 128)")
    parser.add_argument("--ops", default="SUM,PRODUCT,MAX,MIN", help="comma-separated reduce ops")
    parser.add_argument("--stagger", action="store_true", help="rank r's NaNs at r %% 3, r %% 3 + 3, …")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a world may take (then killed)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # no OpenMP pool in the process that forks
    for world in (int(w) for w in args.worlds.split(",")):
        measure_world(world, args.ops.split(","), args.stagger, args.timeout)


if __name__ == "__main__":
    main()
