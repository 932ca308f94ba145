"""Hooks whose rank 1 changes a setting every simulated rank shares (one per setting).

On a real cluster each is harmless to the other ranks: the setting belongs to rank 1's
process (or to the thread running its hook). In one process the other ranks would see it,
so simcluster must report it (``SharedSettingError``) and put it back. ``tidy_*`` hooks
change the same settings and restore them within their turn: nothing to report.
"""

import contextlib
import io
import os
import resource
import signal
import sys
import threading

import torch
import torch.distributed as dist
import torch.utils.deterministic


def _mean(bucket, wait=False):
    """Average the bucket across ranks (``wait``: block on the all_reduce inside the hook)."""
    send = bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(send, async_op=True)
    if wait:
        work.wait()
    return work.get_future().then(lambda f: f.value()[0])


def _on_rank_1(change):
    def hook(process_group, bucket):
        if dist.get_rank() == 1:
            change()
        return _mean(bucket)

    return hook


# -- read at every rank switch: blamed on the rank
flush_denormal = _on_rank_1(lambda: torch.set_flush_denormal(True))
default_device = _on_rank_1(lambda: torch.set_default_device("meta"))
device_block_left_open = _on_rank_1(lambda: torch.device("meta").__enter__())
warn_only = _on_rank_1(lambda: torch.use_deterministic_algorithms(True, warn_only=True))
# -- read when the run starts and ends: reported for the run
chdir = _on_rank_1(lambda: os.chdir(os.path.dirname(os.path.abspath(__file__))))
sys_path = _on_rank_1(lambda: sys.path.insert(0, "/simcluster-test-nowhere"))
recursion_limit = _on_rank_1(lambda: sys.setrecursionlimit(sys.getrecursionlimit() + 123))
anomaly = _on_rank_1(lambda: torch.autograd.set_detect_anomaly(True))
stdout = _on_rank_1(lambda: setattr(sys, "stdout", io.StringIO()))
mkldnn = _on_rank_1(lambda: setattr(torch.backends.mkldnn, "enabled", not torch.backends.mkldnn.enabled))
nnpack = _on_rank_1(lambda: torch._C._set_nnpack_enabled(not torch._C._get_nnpack_enabled()))
fill_uninitialized_memory = _on_rank_1(lambda: setattr(
    torch.utils.deterministic, "fill_uninitialized_memory", not torch.utils.deterministic.fill_uninitialized_memory))


def _count_events(frame, event, arg):
    return None


trace_function = _on_rank_1(lambda: sys.settrace(_count_events))
profile_function = _on_rank_1(lambda: sys.setprofile(_count_events))


def _log_and_exit(*args):
    return None


excepthook = _on_rank_1(lambda: setattr(sys, "excepthook", _log_and_exit))  # a logging library's set-up
unraisablehook = _on_rank_1(lambda: setattr(sys, "unraisablehook", _log_and_exit))
threading_excepthook = _on_rank_1(lambda: setattr(threading, "excepthook", _log_and_exit))
signal_handler = _on_rank_1(lambda: signal.signal(signal.SIGUSR1, _log_and_exit))  # a stack-dump-on-signal helper


def _divide_first(tensor, *args, **kwargs):
    return _ORIGINAL_ALL_REDUCE(tensor.div_(2), *args, **kwargs)


_ORIGINAL_ALL_REDUCE = dist.all_reduce
# a module's attributes: one process's patch on a real cluster, every simulated rank's here
patched_all_reduce = _on_rank_1(lambda: setattr(dist, "all_reduce", _divide_first))
marked_torch_distributed = _on_rank_1(lambda: setattr(dist, "_simcluster_test_patched", True))
deleted_from_torch_futures = _on_rank_1(lambda: delattr(torch.futures, "wait_all"))
hidden_module = _on_rank_1(lambda: sys.modules.__setitem__("numpy", None))  # "import numpy" fails for every rank
# read when a run ends, against the last read: a timer goes off, a limit kills, in a later example
interval_timer = _on_rank_1(lambda: signal.setitimer(signal.ITIMER_REAL, 30, 30))  # a timeout the hook arms
file_limit = _on_rank_1(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (
    resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))


def flush_denormal_then_wait(process_group, bucket):
    """Rank 1 sets flush-denormal and then blocks in its hook: its thread parks and another
    thread, started from it (inheriting its FPU bits), runs the other ranks."""
    if dist.get_rank() == 1:
        torch.set_flush_denormal(True)
    return _mean(bucket, wait=True)


def tidy(process_group, bucket):
    """Changes every watched setting and restores each before its turn ends."""
    cwd, limit = os.getcwd(), sys.getrecursionlimit()
    torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    with torch.device("meta"):
        torch.empty(1)
    with torch.autograd.detect_anomaly(check_nan=False):
        pass
    with contextlib.redirect_stdout(io.StringIO()):
        print("kept")
    os.chdir("/")
    os.chdir(cwd)
    sys.path.insert(0, "/simcluster-test-nowhere")
    sys.path.remove("/simcluster-test-nowhere")
    sys.setrecursionlimit(limit + 1)
    sys.setrecursionlimit(limit)
    return _mean(bucket)


def tidy_across_a_wait(process_group, bucket):
    """``with torch.device(...)`` around a blocking wait: the mode is the rank's own while
    its thread is parked (nobody else runs on it), and left before the hook returns."""
    with torch.device("cpu"):
        return _mean(bucket, wait=True)
