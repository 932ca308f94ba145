"""Small buggy hooks written for the failure-report tests (tests/test_reports.py).

Each has one bug whose report must tell the whole story: which ranks, which calls,
which line, which bucket layout. The hooks are unannotated (DDP's registration check
rejects string annotations and any return annotation but ``Future[Tensor]``), so no
registration failure joins the one under test.
"""

import os

import torch
import torch.distributed as dist


def _mean(bucket: dist.GradBucket, group: object = None) -> torch.futures.Future:
    buf = bucket.buffer()
    size = dist.get_world_size(group)
    fut = dist.all_reduce(buf.div_(size), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def uneven_allreduce_hook(state, bucket):
    """Rank 0 reduces the whole buffer, the others only its first element: a size mismatch."""
    buf = bucket.buffer()
    part = buf if dist.get_rank() == 0 else buf[:1]
    fut = dist.all_reduce(part, async_op=True).get_future()
    return fut.then(lambda f: buf.div_(dist.get_world_size()))


def send_before_recv_hook(state, bucket):
    """A ring exchange where every rank first blocks on its send: nobody reaches its recv."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = bucket.buffer()
    if world > 1:
        dist.send(buf.clone(), dst=(rank + 1) % world)
        dist.recv(torch.empty_like(buf), src=(rank - 1) % world)
    return _mean(bucket)


class GossipState:
    """Picks a gossip peer: crashes at world size 1, and sends rank 0 to itself."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.peer = group.rank() % (group.size() - 1)


def gossip_hook(state, bucket):
    """Sends a copy of the bucket to the state's peer, then averages."""
    dist.isend(bucket.buffer().clone(), dst=state.peer, group=state.group).wait()
    return _mean(bucket, state.group)


def none_on_rank1_hook(state, bucket):
    """Rank 1's future resolves to None (a forgotten return in its callback branch)."""
    rank = dist.get_rank()
    buf = bucket.buffer()
    fut = dist.all_reduce(buf.div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: None if rank == 1 else f.value()[0])


def legacy_none_on_rank1_hook(state, bucket):
    """A PyTorch 1.8-era hook (get_tensors(), a [tensor] result) whose rank 1 resolves to None."""
    rank = dist.get_rank()
    tensor = bucket.get_tensors()[0]
    fut = dist.all_reduce(tensor.div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: None if rank == 1 else [f.value()[0]])


class ResidualByIndex:
    """Error feedback keyed by ``bucket.index()``: the rebuild gives index 0 other parameters."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.residuals: dict[int, torch.Tensor] = {}


def residual_by_index_hook(state, bucket):
    """Adds the residual kept for this bucket index; after the rebuild its size no longer fits."""
    buf = bucket.buffer()
    kept = state.residuals.get(bucket.index())
    if kept is not None:
        buf.add_(kept)  # raises once the rebuild gave this index a bucket of another size
    state.residuals[bucket.index()] = torch.zeros_like(buf)
    return _mean(bucket)


def forgot_division(state, bucket):
    """Sums instead of averaging."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def dies_on_real_gloo_rank1(state, bucket):
    """Correct in the simulator; on real gloo processes rank 1 exits mid-hook (its peers
    then fail with gloo's 'Connection closed by peer')."""
    from simcluster.fake.process_group import SimProcessGroup  # the simulated group wears torch's names

    if dist.get_rank() == 1 and not isinstance(dist.group.WORLD, SimProcessGroup):
        os._exit(3)
    return _mean(bucket)


def callback_indexes_gloo_list(state, bucket):
    """Indexes the all_gather value as NCCL's one tensor; on gloo it is a list: IndexError in the callback."""
    world = dist.get_world_size()
    out = torch.empty(world * bucket.buffer().numel())
    fut = dist.all_gather_into_tensor(out, bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[world].view(world, -1).mean(0))


def returns_band_future(state, bucket):
    """BAND on float gradients: gloo rejects it at wait(); the hook returns that future as is."""
    return dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.BAND, async_op=True).get_future()


def broadcasts_from_callbacks(state, bucket):
    """Posts its second collective from the first one's callback: with two buckets in flight,
    callbacks run in each rank's completion order, so the broadcasts pair up across buckets."""
    t = bucket.buffer()
    result = torch.futures.Future()

    def after_sum(f):
        second = dist.broadcast(t, src=0, async_op=True).get_future()
        second.then(lambda g: result.set_result(t.div_(dist.get_world_size())))

    dist.all_reduce(t, async_op=True).get_future().then(after_sum)
    return result


def gives_up_after_three_polls(state, bucket):
    """Polls its all_reduce three times, then gives up on it (a straggler timeout) and returns
    the local gradient — leaving the collective in flight on DDP's bucket buffer."""
    t = bucket.buffer()
    work = dist.all_reduce(t.div_(dist.get_world_size()), async_op=True)
    for _ in range(3):
        if work.is_completed():
            return work.get_future().then(lambda f: f.value()[0])
    result = torch.futures.Future()
    result.set_result(t.clone().mul_(dist.get_world_size()))
    return result


_NOISE = torch.Generator().manual_seed(7)  # seeded alike in every rank's copy of this module


def draws_noise_in_completion_order(state, bucket):
    """Adds noise drawn from a generator seeded alike on every rank — in the all_reduce's
    callback, so in each rank's completion order: with several buckets, the ranks may hand
    the same draw to different buckets."""
    t = bucket.buffer().div_(dist.get_world_size())

    def add_noise(f):
        mean = f.value()[0]
        return mean.add_(torch.randn(mean.shape, generator=_NOISE))

    return dist.all_reduce(t, async_op=True).get_future().then(add_noise)


def adds_its_rank(state, bucket):
    """Replicas disagree whatever the schedule."""
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0].add_(dist.get_rank()))


def broadcasts_rank_0s(state, bucket):
    """Divides, then broadcasts from rank 0 where an all_reduce was meant: every rank ends
    up with rank 0's gradient over the world size."""
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.broadcast(t, src=0, async_op=True).get_future().then(lambda f: f.value()[0])


def leaves_out_ranks_past_1(state, bucket):
    """Ranks 2 and up put zeros into the all_reduce instead of their gradients: only ranks 0
    and 1's data reach the results."""
    t = bucket.buffer()
    if dist.get_rank() >= 2:
        t.zero_()
    return dist.all_reduce(t.div_(dist.get_world_size()), async_op=True).get_future().then(lambda f: f.value()[0])


def prints_and_forgets_division(state, bucket):
    """Prints a line per call (as debugging hooks do) and sums without dividing."""
    print(f"printing hook: rank {dist.get_rank()} bucket {bucket.index()} holds {bucket.buffer().tolist()}")
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def prints_and_averages(state, bucket):
    """Prints a line per call and averages correctly."""
    print(f"printing hook: rank {dist.get_rank()} bucket {bucket.index()}")
    return _mean(bucket)


def averages_over_world(state, bucket):
    """Averages over WORLD whatever DDP's group: right only when DDP runs on the whole world."""
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def _sent_back(buf, sent, divide_after=False):
    """All-reduce ``sent`` and copy the sum into ``buf`` (divided by the world size when ``divide_after``)."""
    world = dist.get_world_size()
    fut = dist.all_reduce(sent, async_op=True).get_future()
    return fut.then(lambda f: buf.copy_(f.value()[0].div(world) if divide_after else f.value()[0]))


def bf16_cast_then_divide(state, bucket):
    """torch's bf16_compress_hook's order: cast the float32 bucket to bfloat16, divide there,
    sum: a float32 gradient of magnitude from 3.39617753e38 up is inf at the cast."""
    buf = bucket.buffer()
    return _sent_back(buf, buf.to(torch.bfloat16).div_(dist.get_world_size()))


def fp16_divide_then_cast(state, bucket):
    """Divides first, then casts to float16 to nearest: at world size 3, 65504/3 rounds up to
    21840, and three such shares sum to inf."""
    buf = bucket.buffer()
    return _sent_back(buf, buf.div(dist.get_world_size()).to(torch.float16))


def fp16_sum_then_divide(state, bucket):
    """Casts to float16, sums, then divides: the sum overflows past 65504."""
    buf = bucket.buffer()
    return _sent_back(buf, buf.to(torch.float16), divide_after=True)


def mean_over_nonzero_ranks(state, bucket):
    """Divides the sum by the number of ranks whose entry is non-zero: 0/0 = NaN where every
    rank holds 0 — a non-finite result that no overflow explains."""
    buf = bucket.buffer()
    count = (buf != 0).to(buf.dtype)
    dist.all_reduce(count)
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0].div_(count))


def reduces_a_copy_returns_its_own(state, bucket):
    """All-reduces a divided copy of the bucket, then returns the bucket itself: the mean
    never reaches the result, and each rank keeps its own gradients."""
    buf = bucket.buffer()
    fut = dist.all_reduce(buf.clone().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: buf)


def reduces_on_its_own_group(state, bucket):
    """All-reduces the bucket on ``state``, a group holding this rank alone (the factory
    below): a reduction over one rank returns the rank's own gradient. Hooks from the wild,
    round 12: an MoE hook reduces experts' gradients on ``param_group``s built by
    ``dist.new_group`` — one rank each when every node holds its own experts."""
    buf = bucket.buffer()
    return dist.all_reduce(buf, group=state, async_op=True).get_future().then(lambda f: f.value()[0])


def own_rank_group(process_group):
    """Every rank builds a one-rank group for every rank (new_group is collective) and keeps its own."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def rows_of_each_gradient(state, bucket):
    """Reads each gradient's number of rows, ``g.shape[0]`` (GreedyLore's counting hook, hooks
    from the wild round 12): a 0-dim parameter's gradient has none — IndexError on real DDP."""
    rows = sum(g.shape[0] for g in bucket.gradients())
    buf = bucket.buffer()
    return dist.all_reduce(buf.div_(dist.get_world_size()), async_op=True).get_future().then(
        lambda f: f.value()[0] + 0 * rows)


def noop(state, bucket):
    """Communicates nothing: returns a future of the local bucket (torch's debugging noop_hook)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def forgets_one_of_its_futures(state, bucket):
    """Makes its own futures and completes one from the all_reduce's callback; rank 1
    returns another, which nothing completes: DDP's reducer waits on it forever. (Rank 0
    makes one more first, so the two ranks' counts differ.)"""
    buf = bucket.buffer()
    if dist.get_rank() == 0:
        torch.futures.Future()
    done = torch.futures.Future()
    lost = torch.futures.Future()  # never completed
    fut = dist.all_reduce(buf.div_(dist.get_world_size()), async_op=True).get_future()
    fut.then(lambda f: done.set_result(f.value()[0]))
    return lost if dist.get_rank() == 1 else done


def callback_returns_its_future(state, bucket):
    """Its then-callback returns the future it got (a timing hook from the wild): torch
    does not unwrap it; DDP cannot cast a Future to a Tensor."""
    def timed(f):
        return f

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(timed)


def gathers_into_a_flat_output(state, bucket):
    """all_gather_into_tensor of a (1, n) view into a flat output: gloo refuses it at the
    call (the output's chunks must be shaped as the input). torch wraps the call in
    typing_extensions' @deprecated."""
    buf = bucket.buffer()
    out = torch.empty(buf.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(out, buf.view(1, -1))
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def reduces_p_grad_returns_the_buffer(state, bucket):
    """Modulus SFNO's pattern (hooks from the wild, round 7): all-reduces the ``p.grad`` of
    the bucket's parameters and returns the bucket's buffer. Only with
    ``gradient_as_bucket_view=True`` is ``p.grad`` a view of that buffer; by default it is a
    tensor of its own, and each rank keeps its own gradients (real DDP too, measured by e2e)."""
    for p in bucket.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def int8_codes_offset(state, bucket):
    """Sends each gradient as an int8 code — the value rounded, plus 100 — sums the codes and
    takes the offsets off again: two ranks' codes sum to about 200, past int8's 127, and the
    sum wraps around (a quantizer that forgot the world size when it picked its range)."""
    buf = bucket.buffer()
    world = dist.get_world_size()
    codes = (buf.round() + 100).to(torch.int8)
    fut = dist.all_reduce(codes, async_op=True).get_future()
    return fut.then(lambda f: buf.copy_((f.value()[0].to(buf.dtype) - 100 * world) / world))


def reads_local_rank(state, bucket):
    """Logs the rank torchrun puts in ``LOCAL_RANK`` (hivemind's ``custom_post_localSGD_hook``,
    hooks from the wild round 9), then averages: a KeyError outside torchrun."""
    print(f"[rank {os.environ['LOCAL_RANK']}] bucket {bucket.index()}")
    return _mean(bucket)


def reads_its_own_rank_key(state, bucket):
    """A KeyError named like a torchrun variable, from a dict of its own: no launcher hint."""
    return {"rank": _mean(bucket)}["RANK"]


def keeps_its_local_rank(state, bucket):
    """Averages over ``WORLD_SIZE`` from the environment, keeping its gradient only where
    ``LOCAL_RANK`` names the rank it runs on (as a process's would): right under torchrun,
    a KeyError without a launcher, an average of rank 0's alone if every rank saw rank 0's."""
    buf = bucket.buffer()
    buf.mul_(float(int(os.environ["LOCAL_RANK"]) == dist.get_rank()) / int(os.environ["WORLD_SIZE"]))
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0] * float(int(os.environ["LOCAL_RANK"]) == dist.get_rank()))


def drops_local_rank_one(state, bucket):
    """Averages, but the process with ``LOCAL_RANK`` 1 contributes zeros: wrong at world >= 2."""
    if os.environ["LOCAL_RANK"] == "1":
        bucket.buffer().zero_()
    return _mean(bucket)


def sums_centred(state, bucket):
    """Sends each rank's gradients minus their mean and forgets to divide: a constant
    gradient sends zeros (as a compressor clipping at a multiple of the standard deviation
    does: TernGrad from the wild, round 16), so a constant change to a rank moves nothing."""
    buf = bucket.buffer()
    centred = buf - buf.mean()
    return dist.all_reduce(centred, async_op=True).get_future().then(lambda f: f.value()[0])


def extra_call_on_rank0(state, bucket):
    """Rank 0 posts one all_reduce more than the others: rank 1's own (innocent) call is the
    one found mismatched, and the culprit is rank 0's line."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)
    return _mean(bucket)


def divides_but_not_every_seventh_time(process_group, bucket):
    """Forgets the division on one call in seven — counted process-wide, in ``sys``, outside
    every rank's module copy (as a clock or OS entropy would decide): an example that failed
    passes when run again, and no experiment re-running it can say why."""
    import sys

    calls = getattr(sys, "_simcluster_report_hooks_calls", 0)
    sys._simcluster_report_hooks_calls = calls + 1
    buffer = bucket.buffer()
    if (calls // dist.get_world_size()) % 7 != 3:
        buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def skips_the_copy_back_when_already_done(state, bucket):
    """float16 compression with a "fast path": if the all_reduce is already complete when it
    is first polled, skip the callback — and, the bug, the copy-back with it. On real gloo a
    poll right after posting answers pending 86-100 % of the time, so the fast path runs
    rarely, on one rank and not another: the replicas drift apart now and then."""
    buf = bucket.buffer()
    half = buf.to(torch.float16).div_(dist.get_world_size())
    work = dist.all_reduce(half, async_op=True)
    if work.is_completed():  # the fast path
        fut = torch.futures.Future()
        fut.set_result(buf)  # BUG: buf never receives the reduced values
        return fut
    return work.get_future().then(lambda f: buf.copy_(f.value()[0]))


def divides_after_posting(state, bucket):
    """Posts the all_reduce, then divides the buffer in place while it is in flight (meant
    to divide first): on real gloo the result mixes the values before and after the
    division, differently on each rank (docs/gloo-facts.md §14)."""
    buf = bucket.buffer()
    fut = dist.all_reduce(buf, async_op=True).get_future()  # posts buf
    buf.div_(dist.get_world_size())  # BUG: writes to buf while the all_reduce has it in flight
    return fut.then(lambda f: f.value()[0])


def forgets_its_all_reduce(state, bucket):
    """Divides, posts the all_reduce and returns a future it completed itself, never waiting
    for the all_reduce ("fire and forget"): real DDP copies the bucket back before the
    all_reduce writes, 193-200 times in 200 (docs/ddp-facts.md)."""
    buf = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(buf, async_op=True)  # never waited on
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


_STAGING: dict[str, torch.Tensor] = {}


def shares_one_staging_buffer(state, bucket):
    """Stages every bucket in one module-level buffer, to save allocations: with two buckets in
    flight, the second bucket's hook call overwrites what the first one's all_reduce still
    has in flight (a pattern from hooks in the wild; the report names that call and line)."""
    n = bucket.buffer().numel()
    staging = _STAGING.get("buffer")
    if staging is None or staging.numel() < n:
        staging = _STAGING["buffer"] = torch.empty(4 * n)
    view = staging[:n]
    view.copy_(bucket.buffer())  # stages this bucket
    view.div_(dist.get_world_size())
    fut = dist.all_reduce(view, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].clone())


def divides_chunk_after_posting_another(state, bucket):
    """Pipelined by halves: divides a half, posts it, then divides the other half — a write
    to the buffer's memory while the first half is in flight, but not to that half: no race."""
    buf = bucket.buffer()
    half = buf.numel() // 2
    first, second = buf[:half], buf[half:]
    works = [dist.all_reduce(first.div_(dist.get_world_size()), async_op=True)]
    works.append(dist.all_reduce(second.div_(dist.get_world_size()), async_op=True))
    return torch.futures.collect_all([w.get_future() for w in works]).then(lambda _: buf)


def concatenates_parameters_reversed(state, bucket):
    """One all_reduce per parameter, posted last to first, the results concatenated in that
    order: with two equal parameters in one bucket, each gets the other's average."""
    futs = [dist.all_reduce(g.detach().clone().reshape(-1).div_(dist.get_world_size()), async_op=True).get_future()
            for g in reversed(bucket.gradients())]
    return torch.futures.collect_all(futs).then(lambda f: torch.cat([x.value()[0] for x in f.value()]))


def adds_a_process_wide_draw(process_group, bucket):
    """Adds its rank to its average's first element — the same report every run — and to the
    second a number counted process-wide (in ``sys``, as a generator seeded from OS entropy
    would draw one), alike on every rank: each run's results differ from the last where the
    report does not look."""
    import sys

    draw = getattr(sys, "_simcluster_report_hooks_draws", 0)
    sys._simcluster_report_hooks_draws = draw + 1
    world, rank = dist.get_world_size(), dist.get_rank()

    def drift(f):
        out = f.value().clone()
        out[0] += rank
        out[-1] += draw // world
        return out
    return _mean(bucket).then(drift)


def raises_a_process_wide_count(state, bucket):
    """Rank 1 raises, naming a number counted process-wide (in ``sys``): the same failure on
    every run — property, type, step — told with another number each time."""
    import sys

    draw = getattr(sys, "_simcluster_report_hooks_raises", 0)
    sys._simcluster_report_hooks_raises = draw + 1
    if dist.get_rank() == 1:
        raise ValueError(f"draw {draw} was unlucky")
    return _mean(bucket)


def raises_in_rank_1s_callback(state, bucket):
    """Rank 1's callback raises (a local check gone wrong); the other ranks' steps complete."""
    rank = dist.get_rank()

    def check(f):
        if rank == 1:
            raise FloatingPointError("rank 1 found a non-finite value")
        return f.value()[0]
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(check)


class _Config:
    def __init__(self, process_group):
        self.scale = None


def make_config(process_group):
    return _Config(process_group)


def asserts_with_its_states_repr(state, bucket):
    """Fails its own assert, quoting its state's default repr — an address, new every run."""
    assert state.scale is not None, f"state {state!r} has no scale"
    return _mean(bucket)


def asserts_with_ids(state, bucket):
    """Fails its own check, quoting the ids and the storage address it keys on — numbers that
    differ every run (address-space randomisation), in decimal and in hex."""
    buffer = bucket.buffer()
    if bucket.index() == 0:
        raise RuntimeError(f"bucket {id(bucket)} (state {id(state)}, storage {hex(buffer.data_ptr())}, "
                           f"{buffer.data_ptr()}) not registered; {buffer.numel()} elements")
    return _mean(bucket)


def returns_its_own_bucket(state, bucket):
    """Communicates nothing: a future completed with the rank's own bucket."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def averages_then_adds_its_rank(state, bucket):
    """The mean, then a per-rank offset of a quarter: within a loose norm= tolerance, not rounding."""
    buf = bucket.buffer().div_(dist.get_world_size())
    rank = dist.get_rank()
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0].add_(0.25 * rank))


def divides_on_rank_0_only(state, bucket):
    """Rank 0 divides its share, the others forget to."""
    buf = bucket.buffer()
    if dist.get_rank() == 0:
        buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


class ResidualByShape:
    """Error feedback whose residual is keyed by the parameter's shape: two parameters of one
    shape share (and overwrite) one residual, whatever DDP's buckets."""

    def __init__(self, process_group):
        self.residuals = {}


def sign_with_residual_by_shape(state, bucket):
    pieces = []
    for p, grad in zip(bucket.parameters(), bucket.gradients()):
        key = tuple(p.shape)  # BUG: two parameters of one shape share one residual
        corrected = grad + state.residuals.get(key, torch.zeros_like(grad))
        sent = corrected.sign() * corrected.abs().mean()
        state.residuals[key] = corrected - sent
        pieces.append(sent.reshape(-1))
    flat = torch.cat(pieces).div_(dist.get_world_size())
    return dist.all_reduce(flat, async_op=True).get_future().then(lambda f: f.value()[0])


def sums_in_float64_then_narrows(state, bucket):
    """Sums in float64 (no overflow there), casts the sum to float32, then divides: the cast
    overflows before the division."""
    wide = bucket.buffer().to(torch.float64)
    return dist.all_reduce(wide, async_op=True).get_future().then(
        lambda f: f.value()[0].to(torch.float32).div_(dist.get_world_size()))


def joins_the_last_chunk_only(state, bucket):
    """Halves of the bucket, an all_reduce each, and a future tied to the second only: on gloo
    the second may complete first, and DDP then copies the bucket while the first still writes."""
    buf = bucket.buffer().div_(dist.get_world_size())
    futures = [dist.all_reduce(half, async_op=True).get_future() for half in buf.chunk(2)]
    return futures[-1].then(lambda f: buf)


def joins_every_chunk(state, bucket):
    """The same, joined with collect_all: the future completes once both have."""
    buf = bucket.buffer().div_(dist.get_world_size())
    futures = [dist.all_reduce(half, async_op=True).get_future() for half in buf.chunk(2)]
    return torch.futures.collect_all(futures).then(lambda f: buf)


def dtype_from_local_data_hook(state, bucket):
    """Each rank picks fp32 or bf16 from its own gradients: either rank may be the one that
    posts bf16, so the same mismatch comes out with the ranks' roles swapped."""
    buf = bucket.buffer()
    if buf.numel() and buf.abs().max() > 1e4:
        return _mean(bucket)
    t = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(t, async_op=True).get_future()
    return fut.then(lambda f: buf.copy_(f.value()[0]))


def _scaled_mean(bucket, wait_first):
    """Quantise by a scale MAX-reduced across ranks; read the scale before or after waiting."""
    buf = bucket.buffer()
    scale = buf.abs().max().reshape(1).clamp_min(1.0)
    work = dist.all_reduce(scale, op=dist.ReduceOp.MAX, async_op=True)
    if wait_first:
        work.wait()
    step = scale.item() / 100  # read while the MAX is in flight unless waited for
    work.wait()
    q = torch.round(buf / step)
    fut = dist.all_reduce(q, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].mul_(step).div_(dist.get_world_size()))


def scale_read_in_flight_hook(state, bucket):
    return _scaled_mean(bucket, wait_first=False)


def scale_read_after_wait_hook(state, bucket):
    return _scaled_mean(bucket, wait_first=True)


def _nested_count(depth):  # never stops: RecursionError
    return _nested_count(depth + 1) + 1


def _ping(depth):  # with _pong: never stops
    return _pong(depth + 1)


def _pong(depth):
    return _ping(depth + 1)


def mutually_recursing_hook(state, bucket):
    """Two functions calling each other without end: a report must show the pair once, under
    the hook's line that began it."""
    _ping(0)
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def recursing_hook(state, bucket):
    """Recurses without end before it all-reduces: a report must name where the hook began the
    recursion, not three copies of the recursing line."""
    _nested_count(0)
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


_steps_seen = 0


def hangs_in_its_fourth_step(state, bucket):
    """Averages correctly for three steps; in the fourth, rank 1 returns a future nothing ever
    completes while rank 0 waits for rank 1's all_reduce: a deadlock. Deterministic — the
    module is each rank's own copy, made anew for every run — so the failure repeats."""
    global _steps_seen
    fourth = _steps_seen == 3
    if bucket.is_last():
        _steps_seen += 1
    if fourth and dist.get_rank() == 1:
        return torch.futures.Future()
    return _mean(bucket)
