"""The real-gloo runner: results per rank, failures with the failing rank's traceback,
hangs killed within the timeout with no child left, and a real collective check.

One persistent world (module fixture) carries most tests, so the file costs about two
world start-ups (~1.5 s each) plus the restarts after the deliberate failures. The job
functions below are module-level because the children import them by name.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest

from simcluster.errors import GlooRunError, TargetLoadError, UsageError
from simcluster.real.gloo_runner import GlooCluster, is_consequence, primary_ranks, run_gloo

pytestmark = pytest.mark.gloo


# ---------------------------------------------------------------- jobs (run in the children)


def collective_job(rank: int, world_size: int, payload: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    summed = torch.tensor([float(payload)])
    dist.all_reduce(summed)
    gathered = [torch.empty(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank * 10)]))
    return {"rank": rank, "world_size": world_size, "payload": payload, "pid": os.getpid(),
            "sum": summed.item(), "gathered": [t.item() for t in gathered],
            "threads": torch.get_num_threads(), "rand": torch.rand(3).tolist()}


def raise_on_rank_1(rank: int, world_size: int, payload: Any) -> int:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for rank 1 here, then loses its peer
    return rank


def hang_on_rank_0(rank: int, world_size: int, payload: Any) -> int:
    if rank == 0:
        time.sleep(3600)
    return rank


def leaves_a_failed_collective(rank: int, world_size: int, payload: Any) -> float:
    """Returns with an all_reduce gloo refuses at wait() (BAND on floats) never waited on,
    still queued behind two all_reduces that wait for rank 1 (which posts 0.3 s late) on
    both of gloo's worker threads."""
    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(0.3)
    dist.all_reduce(torch.ones(4), async_op=True)
    dist.all_reduce(torch.ones(4), async_op=True)
    dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND, async_op=True)
    return float(rank)


def mismatched_sizes(rank: int, world_size: int, payload: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(4 if rank == 0 else 5))  # gloo aborts the process


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def cluster() -> Iterator[GlooCluster]:
    with GlooCluster(2, timeout=30.0, start_method="forkserver") as c:
        yield c


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_run_gloo_returns_each_ranks_result_in_rank_order() -> None:
    results = run_gloo(collective_job, 2, payloads=[1.5, 2.0], timeout=120.0)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["payload"] for r in results] == [1.5, 2.0]
    assert [r["world_size"] for r in results] == [2, 2]
    assert [r["sum"] for r in results] == [3.5, 3.5]
    assert [r["gathered"] for r in results] == [[0.0, 10.0], [0.0, 10.0]]
    assert [r["threads"] for r in results] == [1, 1]
    assert results[0]["pid"] != results[1]["pid"]
    assert not any(_alive(r["pid"]) for r in results)


def test_a_subprocess_child_imports_no_parent_side_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``python -c`` child runs gloo_child only: the job (a module that imports no
    simcluster) sees which simcluster modules its process has loaded."""
    (tmp_path / "child_modules_probe.py").write_text(
        "import sys\n\n"
        "def job(rank, world_size, payload):\n"
        "    return sorted(m for m in sys.modules if m.startswith('simcluster'))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    [loaded] = run_gloo("child_modules_probe:job", 1, timeout=120.0, start_method="subprocess")
    assert "simcluster.real.gloo_child" in loaded  # the probe saw the child's modules, not an empty list
    assert "simcluster.real.gloo_runner" not in loaded, loaded
    assert not [m for m in loaded if m.split(".")[1:2] not in (["errors"], ["real"], [])], loaded


def test_cluster_reuses_processes_and_resets_rng_between_jobs(cluster: GlooCluster) -> None:
    first = cluster.run(collective_job, payloads=[1, 2])
    second = cluster.run("test_gloo_runner:collective_job", payloads=[3, 4])
    assert [r["sum"] for r in first] == [3.0, 3.0]
    assert [r["sum"] for r in second] == [7.0, 7.0]
    assert [r["pid"] for r in first] == [r["pid"] for r in second]
    assert [r["rand"] for r in first] == [r["rand"] for r in second]  # as if fresh
    assert first[0]["rand"] != first[1]["rand"]  # ranks are separate processes


def test_a_collective_the_job_let_fail_does_not_fail_the_closing_rendezvous(cluster: GlooCluster) -> None:
    """gloo's own barrier re-raises the error of any work its workers still hold (measured:
    at once for a failed all_reduce not waited on, docs/gloo-facts.md); the runner's closing
    rendezvous must not, or a job that caught (or ignored) an error fails the run."""
    for _ in range(3):
        assert cluster.run(leaves_a_failed_collective) == [0.0, 1.0]
    assert [r["sum"] for r in cluster.run(collective_job, payloads=[1, 2])] == [3.0, 3.0]  # the world still works


def test_raising_rank_is_reported_with_its_own_traceback(cluster: GlooCluster) -> None:
    cluster.run(collective_job, payloads=[0, 0])  # a live world, whichever test ran before
    starts = cluster.starts
    with pytest.raises(GlooRunError) as info:
        cluster.run(raise_on_rank_1)
    message = str(info.value)
    assert "rank 1 failed first" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert "in raise_on_rank_1" in info.value.failures[1]
    assert "reproduce: python -c" in message
    # the next job gets a fresh world
    assert [r["sum"] for r in cluster.run(collective_job, payloads=[1, 1])] == [2.0, 2.0]
    assert cluster.starts == starts + 1


def test_a_timeout_is_a_consequence_only_where_failed_ranks_stay() -> None:
    """gloo_runner's failed rank leaves at once, so a peer's closed connection is the
    consequence and a timeout is a rank's own; under torchrun (``timeouts=True``) a failed
    rank stays until the verdict, so its peers time out instead."""
    closed = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1234."
    timed_out = "RuntimeError: [pair.cc:598] Timed out waiting 5000ms for recv operation to complete"
    own = "ValueError: deliberate failure on rank 1"
    assert is_consequence(closed) and is_consequence(closed, timeouts=True)
    assert not is_consequence(timed_out) and is_consequence(timed_out, timeouts=True)
    assert not is_consequence(own, timeouts=True)
    assert primary_ranks({0: closed, 2: timed_out, 1: own}) == [2, 1]
    assert primary_ranks({1: closed, 0: closed}) == [1]  # all consequences: the first to report


def test_hang_is_killed_within_the_timeout_and_no_child_survives(cluster: GlooCluster) -> None:
    pids = [r["pid"] for r in cluster.run(collective_job, payloads=[0, 0])]
    began = time.monotonic()
    with pytest.raises(GlooRunError) as info:
        cluster.run(hang_on_rank_0, timeout=1.0)
    assert time.monotonic() - began < 1.0 + 5.0
    assert 0 in info.value.unfinished
    assert "did not finish within timeout=1 s" in str(info.value)
    assert "rank 0: in the job test_gloo_runner:hang_on_rank_0" in str(info.value)
    assert not any(_alive(pid) for pid in pids)


def test_rank_killed_by_gloo_abort_shows_its_output(cluster: GlooCluster) -> None:
    with pytest.raises(GlooRunError) as info:
        cluster.run(mismatched_sizes)
    message = str(info.value)
    assert "was killed by SIGABRT while in the job test_gloo_runner:mismatched_sizes" in message
    assert "Is there a distributed collective mismatch in your code?" in message


def test_bad_targets_and_payloads_fail_before_any_process_starts() -> None:
    with pytest.raises(UsageError, match="module-level function"):
        run_gloo(lambda rank, world_size, payload: rank, 2)
    with pytest.raises(TargetLoadError, match="could not be loaded"):
        run_gloo("test_gloo_runner:no_such_job", 2)
    with pytest.raises(UsageError, match="needs one per rank"):
        run_gloo(collective_job, 2, payloads=[1])
    with pytest.raises(UsageError, match="world_size"):
        GlooCluster(0)


_START_FORK_SERVER = """
import multiprocessing, multiprocessing.forkserver as forkserver, sys
if sys.argv[1] == "prepared":
    from simcluster.real.gloo_runner import _short_multiprocessing_temp_dir
    _short_multiprocessing_temp_dir()
multiprocessing.get_context("forkserver")
forkserver.ensure_running()
print("listening at", forkserver._forkserver._forkserver_address)
"""


@pytest.mark.parametrize("prepared", [False, True])
def test_the_fork_server_starts_under_a_long_tmpdir(tmp_path: Path, prepared: bool) -> None:
    """multiprocessing puts the fork server's Unix socket under TMPDIR; a path over 107
    bytes cannot be bound. The runner moves only that socket's directory to a short temp
    dir; without it (the control case) the server fails as it used to in `simcluster e2e`."""
    import subprocess
    import sys

    long_dir = tmp_path / ("x" * 60) / ("y" * 60)
    long_dir.mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", _START_FORK_SERVER, "prepared" if prepared else "bare"],
                          env=dict(os.environ, TMPDIR=str(long_dir)), capture_output=True, text=True, timeout=120)
    if prepared:
        assert done.returncode == 0, done.stderr
        address = done.stdout.split("listening at ", 1)[1].strip()
        assert len(address) <= 107 and not address.startswith(str(long_dir))
    else:
        assert done.returncode != 0 and "AF_UNIX path too long" in done.stderr
