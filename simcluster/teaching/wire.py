"""Bytes on the wire and an α-β estimate of communication time, per collective.

The simulator computes a collective's *result*; this module says what the backend's
*algorithm* sends to do it — per rank, in bytes — and how long that takes on a network
with per-message latency α and bandwidth β (Hockney's model: a message of ``m`` bytes
costs ``α + m/β``; a rank's messages go one after another).

With ``W`` ranks in the group, ``n`` the bytes of a rank's tensor (the ``nbytes`` a
:class:`~simcluster.engine.trace.Posted` event records) and ``p`` a rank's position in the group:

============================  ====================================  ==========================
collective                    bytes sent by each rank               messages per rank
============================  ====================================  ==========================
all_reduce (ring)             ``2(W−1)/W · n`` (exactly: all chunks  ``2(W−1)``
                              but two of the W-way split, so ranks
                              differ by a chunk when W ∤ n)
all_gather (ring)             ``(W−1) · n``                          ``W−1``
reduce_scatter (ring)         ``(W−1) · n`` (n: the output chunk)    ``W−1``
broadcast, scatter            gloo: root ``(W−1) · n``, others 0     root ``W−1``, others 1
                              (one-to-all); nccl broadcast: ring
                              pipeline, every rank but the last ``n``
reduce, gather                every non-root rank ``n``; root 0      non-root 1, root ``W−1``
all_to_all                    ``(W−1)/W · n`` (equal splits)         ``W−1``
send / recv                   sender ``n``                           1
barrier                       0                                      ``2(W−1)``
============================  ====================================  ==========================

A rank's time is ``messages·α + max(bytes sent, bytes received)/β``; a collective takes
the slowest rank's. Presets (``--network``): ``ethernet25`` — α = 20 µs, β = 25 Gb/s (the
default: TCP over a 25 GbE link, gloo's usual home); ``ib200`` — α = 2 µs, β = 200 Gb/s
(HDR InfiniBand). Or ``LATENCY_US,BANDWIDTH_GBIT`` such as ``5,100``.

>>> bytes_sent("all_reduce", 40, 4, position=0, elsize=4)    # 10 floats, chunks 3,3,2,2
60
>>> bytes_sent("all_gather", 40, 4, position=0)
120
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from simcluster.errors import UsageError

__all__ = ["Network", "PRESETS", "DEFAULT_NETWORK", "parse_network", "ring_chunks", "bytes_sent",
           "bytes_received", "messages", "collective_time", "RING_OPS", "WireRow",
           "wire_rows", "allreduce_baseline", "element_size"]

RING_OPS = ("all_reduce", "all_reduce_coalesced")
_GATHER_LIKE = ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")
_ONE_TO_ALL = ("broadcast", "scatter")
_ALL_TO_ONE = ("reduce", "gather")
_ALL_TO_ALL = ("all_to_all", "all_to_all_single")


@dataclass(frozen=True)
class Network:
    """α (seconds per message) and β (bytes per second)."""

    name: str
    latency_s: float
    bandwidth_bytes_s: float

    def describe(self) -> str:
        return f"{self.name}: α = {self.latency_s * 1e6:g} µs, β = {self.bandwidth_bytes_s * 8 / 1e9:g} Gb/s"


PRESETS = {
    "ethernet25": Network("ethernet25", 20e-6, 25e9 / 8),
    "ib200": Network("ib200", 2e-6, 200e9 / 8),
}
DEFAULT_NETWORK = "ethernet25"


def parse_network(text: str) -> Network:
    """``--network``: a preset name or ``LATENCY_US,BANDWIDTH_GBIT`` (``"20,25"``)."""
    key = str(text).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    parts = key.split(",")
    try:
        latency, bandwidth = (float(p) for p in parts)
    except ValueError:
        latency = bandwidth = -1.0
    if len(parts) != 2 or not (0 <= latency < 1e9 and 0 < bandwidth < 1e9):
        raise UsageError(f"--network {text!r}: use {' or '.join(PRESETS)} or LATENCY_US,BANDWIDTH_GBIT "
                         "(e.g. 20,25: 20 µs per message, 25 Gb/s)")
    return Network(f"{latency:g} µs, {bandwidth:g} Gb/s", latency * 1e-6, bandwidth * 1e9 / 8)


def ring_chunks(elements: int, world: int) -> list[int]:
    """The W-way split of a ring all_reduce: sizes differ by at most one, larger first."""
    return [elements // world + (1 if i < elements % world else 0) for i in range(world)]


def bytes_sent(op: str, nbytes: int, world: int, *, position: int, root: int = 0, elsize: int = 1,
               backend: str = "gloo") -> int:
    """Bytes the rank at ``position`` of a ``world``-rank group sends for one ``op`` of ``nbytes``
    per rank (``elsize``: bytes per element, for the ring's element-wise split)."""
    if world == 1:
        return 0
    if op in RING_OPS:
        c = ring_chunks(nbytes // max(elsize, 1), world)
        return (2 * sum(c) - c[(position + 1) % world] - c[(position + 2) % world]) * elsize
    if op in _GATHER_LIKE:
        return (world - 1) * nbytes
    if op in _ONE_TO_ALL:
        if op == "broadcast" and backend == "nccl":
            return 0 if position == (root - 1) % world else nbytes
        return (world - 1) * nbytes if position == root else 0
    if op in _ALL_TO_ONE:
        return 0 if position == root else nbytes
    if op in _ALL_TO_ALL:
        return nbytes * (world - 1) // world
    if op == "send":
        return nbytes
    return 0  # recv (the sender's side counts), barrier


def bytes_received(op: str, nbytes: int, world: int, *, position: int, root: int = 0, elsize: int = 1,
                   backend: str = "gloo") -> int:
    """Bytes the rank at ``position`` receives (a ring rank receives what its predecessor sends)."""
    if world == 1:
        return 0
    if op in RING_OPS + _GATHER_LIKE + _ALL_TO_ALL:
        return bytes_sent(op, nbytes, world, position=(position - 1) % world, elsize=elsize)
    if op in _ONE_TO_ALL:
        if op == "broadcast" and backend == "nccl":
            return 0 if position == root else nbytes
        return 0 if position == root else nbytes
    if op in _ALL_TO_ONE:
        return (world - 1) * nbytes if position == root else 0
    return nbytes if op == "recv" else 0


def messages(op: str, world: int, *, position: int, root: int = 0) -> int:
    """Messages the rank sends or receives one after another (each costs α)."""
    if world == 1:
        return 0
    if op in RING_OPS or op == "barrier":
        return 2 * (world - 1)
    if op in _GATHER_LIKE + _ALL_TO_ALL:
        return world - 1
    if op in _ONE_TO_ALL + _ALL_TO_ONE:
        return world - 1 if position == root else 1
    return 1


def collective_time(op: str, nbytes: int, world: int, network: Network, *, root: int = 0, elsize: int = 1,
                    backend: str = "gloo", positions: Sequence[int] | None = None) -> float:
    """Hockney estimate in seconds: the slowest rank's ``messages·α + max(sent, received)/β``."""
    if world == 1:
        return 0.0
    worst = 0.0
    for p in positions if positions is not None else range(world):
        volume = max(bytes_sent(op, nbytes, world, position=p, root=root, elsize=elsize, backend=backend),
                     bytes_received(op, nbytes, world, position=p, root=root, elsize=elsize, backend=backend))
        worst = max(worst, messages(op, world, position=p, root=root) * network.latency_s
                    + volume / network.bandwidth_bytes_s)
    return worst


@dataclass(frozen=True)
class WireRow:
    """One collective of a trace: ``sent[i]`` bytes sent by ``ranks[i]``; ``seconds`` its α-β time."""

    op: str
    group: str
    seq: int
    ranks: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    sent: tuple[int, ...]
    seconds: float


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype name as the trace writes it (``"float16"``); 1 if unknown."""
    import torch

    dt = getattr(torch, dtype, None)
    return dt.itemsize if isinstance(dt, torch.dtype) else 1


def _root(detail: str) -> int:
    _, sep, rest = detail.partition("root ")
    return int(rest.split(",")[0].split()[0]) if sep else 0


def wire_rows(events: Sequence[object], backend: str, network: Network) -> list[WireRow]:
    """Each collective posted in ``events`` (a trace's events), with its bytes and time."""
    from simcluster.engine.trace import Posted

    posts: dict[tuple[str, int], list[Posted]] = {}
    for e in events:
        if isinstance(e, Posted):
            posts.setdefault((e.group, e.seq), []).append(e)
    rows = []
    for (group, seq), posted in posts.items():
        ps = sorted(posted, key=lambda p: p.rank)  # told by rank, whichever rank posted first
        first = ps[0]
        ranks = tuple(p.rank for p in ps)
        world = 2 if " p2p " in group else len(ranks)
        order = sorted(ranks)
        elsize, root = element_size(first.dtype), _root(first.detail)
        if " p2p " in group:
            sent = tuple(bytes_sent(p.op, p.nbytes, 2, position=0) for p in ps)
            seconds = network.latency_s + first.nbytes / network.bandwidth_bytes_s
        else:
            sent = tuple(bytes_sent(p.op, p.nbytes, world, position=order.index(p.rank), root=root,
                                    elsize=elsize, backend=backend) for p in ps)
            seconds = collective_time(first.op, first.nbytes, world, network, root=root, elsize=elsize,
                                      backend=backend)
        rows.append(WireRow(first.op, group, seq, ranks, first.dtype, first.shape, first.nbytes, sent, seconds))
    return rows


def allreduce_baseline(bucket_numel: Sequence[int], world: int, *, position: int = 0, elsize: int = 4) -> int:
    """Bytes rank ``position`` sends when plain ``allreduce_hook`` reduces these buckets (float32)."""
    return sum(bytes_sent("all_reduce", n * elsize, world, position=position, elsize=elsize) for n in bucket_numel)
