"""Bytes on the wire: simcluster.teaching.wire's formulas against an independent, message-by-message
model of each backend algorithm, fed with the payloads the simulator's trace records."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from simcluster import SimCluster
from simcluster.errors import UsageError
from simcluster.teaching.wire import PRESETS, bytes_sent, collective_time, parse_network, wire_rows


def ring_allreduce_messages(vectors: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """Run a ring all_reduce chunk by chunk on real data; bytes each rank sent, and each rank's result."""
    w = len(vectors)
    chunks = [list(v.clone().tensor_split(w)) for v in vectors]
    sent = [0] * w
    for s in range(w - 1):  # reduce-scatter: rank p sends chunk (p - s) to p + 1, which adds it
        moves = [(p, (p - s) % w, chunks[p][(p - s) % w].clone()) for p in range(w)]
        for p, c, data in moves:
            sent[p] += data.numel() * data.element_size()
            chunks[(p + 1) % w][c] += data
    for s in range(w - 1):  # all-gather: rank p forwards the finished chunk (p + 1 - s)
        moves = [(p, (p + 1 - s) % w, chunks[p][(p + 1 - s) % w].clone()) for p in range(w)]
        for p, c, data in moves:
            sent[p] += data.numel() * data.element_size()
            chunks[(p + 1) % w][c] = data
    return sent, [torch.cat(c) for c in chunks]


def messages_of(op: str, w: int, n: int, root: int, backend: str) -> list[int]:
    """Bytes each rank sends, message by message, for the textbook algorithm of ``op``."""
    sent = [0] * w
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"):
        for _ in range(w - 1):  # ring: every rank forwards one block of n bytes per step
            for p in range(w):
                sent[p] += n
    elif op == "broadcast" and backend == "nccl":
        for hop in range(w - 1):  # ring pipeline from the root
            sent[(root + hop) % w] += n
    elif op in ("broadcast", "scatter"):
        for dst in range(w):
            if dst != root:
                sent[root] += n
    elif op in ("reduce", "gather"):
        for src in range(w):
            if src != root:
                sent[src] += n
    elif op in ("all_to_all", "all_to_all_single"):
        for p in range(w):
            for q in range(w):
                if q != p:
                    sent[p] += n // w
    return sent


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("elements", [1, 7, 10, 12, 1000])
def test_ring_all_reduce_bytes_match_a_chunk_by_chunk_ring(w: int, elements: int) -> None:
    gen = torch.Generator().manual_seed(w * 100 + elements)
    vectors = [torch.randint(-8, 9, (elements,), generator=gen).to(torch.float32) for _ in range(w)]
    sent, results = ring_allreduce_messages(vectors)
    total = torch.stack(vectors).sum(0)
    assert all(torch.equal(r, total) for r in results)  # the model is a real all_reduce
    assert [bytes_sent("all_reduce", 4 * elements, w, position=p, elsize=4) for p in range(w)] == sent
    if w > 1 and elements % w == 0:
        assert sent == [2 * (w - 1) * 4 * elements // w] * w  # the textbook 2(W−1)/W·n


def _every_collective(rank: int) -> None:
    w = dist.get_world_size()
    t = torch.ones(6)
    dist.all_reduce(t)
    dist.all_gather([torch.zeros(6) for _ in range(w)], t)
    dist.all_gather_into_tensor(torch.zeros(6 * w), t)
    dist.reduce_scatter(torch.zeros(6), [torch.ones(6) for _ in range(w)])
    dist.reduce_scatter_tensor(torch.zeros(6), torch.ones(6 * w))
    dist.broadcast(t, src=1)
    dist.reduce(t, dst=1)
    dist.gather(t, [torch.zeros(6) for _ in range(w)] if rank == 1 else None, dst=1)
    dist.scatter(torch.zeros(6), [torch.ones(6) for _ in range(w)] if rank == 1 else None, src=1)
    dist.all_to_all([torch.zeros(2) for _ in range(w)], [torch.ones(2) for _ in range(w)])
    dist.all_to_all_single(torch.zeros(2 * w), torch.ones(2 * w))
    if rank == 0:
        dist.send(torch.ones(5), dst=1)
    elif rank == 1:
        dist.recv(torch.zeros(5), src=0)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("w", [2, 3, 4])
def test_every_collective_traced_by_the_simulator_moves_what_the_message_model_moves(backend: str, w: int) -> None:
    run = SimCluster(world_size=w, seed=0, backend=backend, schedule="in_order").run(_every_collective)
    rows = wire_rows(run.trace.events, backend, PRESETS["ethernet25"])
    ops = {row.op for row in rows}
    assert ops >= {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                   "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send"}
    for row in rows:
        if row.op == "all_reduce":
            expected, _ = ring_allreduce_messages([torch.ones(6)] * w)
        elif row.op == "send":  # the p2p channel: sender and receiver
            expected = [20, 0]
        else:
            expected = messages_of(row.op, w, row.nbytes, 1, backend)
        got = [row.sent[row.ranks.index(r)] for r in sorted(row.ranks)]
        assert got == expected, row


def test_alpha_beta_time_and_network_option() -> None:
    net = parse_network("10,8")  # 10 µs, 8 Gb/s = 1e9 B/s
    assert net.latency_s == pytest.approx(10e-6) and net.bandwidth_bytes_s == pytest.approx(1e9)
    # ring all_reduce of 4000 B at W=4: 6 messages and 2·3/4·4000 = 6000 B
    assert collective_time("all_reduce", 4000, 4, net, elsize=4) == pytest.approx(6 * 10e-6 + 6000 / 1e9)
    assert parse_network("IB200") is PRESETS["ib200"]
    for bad in ("fast", "1,0", "1,2,3", "-1,5"):
        with pytest.raises(UsageError):
            parse_network(bad)


def test_a_collectives_ranks_are_told_in_rank_order_whoever_posted_first() -> None:
    # THC's hook (hooks from the wild, 2026-12-04): rank 1 posted its bf16 all_reduce before
    # rank 0, and explain said 'ranks [1, 0] … rank 1: 128 B, rank 0: 128 B'
    from simcluster.engine.trace import Posted

    events = [Posted(1, "all_reduce", "WORLD", 2, 0, "bfloat16", (64,), 128, "SUM"),
              Posted(0, "all_reduce", "WORLD", 2, 0, "bfloat16", (64,), 128, "SUM")]
    (row,) = wire_rows(events, "gloo", PRESETS["ethernet25"])
    assert row.ranks == (0, 1)
    assert row.sent == (bytes_sent("all_reduce", 128, 2, position=0, elsize=2, backend="gloo"),
                        bytes_sent("all_reduce", 128, 2, position=1, elsize=2, backend="gloo"))
