"""Survey the process-wide (and thread-wide) state a hook can change: the getter's cost,
whether the state reaches code run later (another simulated rank), and whether torch's
first optimizer step (a burst of first imports) changes it.

Why: ``simcluster.usercode.rank_state.SettingsAudit`` reads its settings at every rank
switch (17 switches per world-8 ``run_hook`` step), so what it reads must be cheap; what
it does not read is shared by every simulated rank and must be documented as such
(docs/isolation.md, "Process-wide settings" and "Not audited").

    python benchmarks/measure_shared_settings.py [--number 200000]

Prints, per candidate: the getter timed with ``timeit`` (best of 5, ns per call; ratios
matter, this VM is shared), whether a change made on one thread is seen by a thread
started before it ("thread-local" below means no: every simulated rank that runs on the
same OS thread still sees it), and whether one ``AdamW.step()`` after ``import torch``
(824 first imports, among them sympy and inductor) changed the value.
"""

from __future__ import annotations

import _signal
import argparse
import gc
import logging
import os
import signal
import sys
import threading
import timeit
from collections.abc import Callable
from typing import Any

import torch

_TINY = 5e-324  # the smallest float64 subnormal: x * 1.0 is 0.0 when denormals flush (DAZ/FTZ)


def _flush_denormal_probe() -> bool:
    """True when this thread's FPU flushes subnormals: torch has no getter for
    ``torch.set_flush_denormal`` (no ``torch._C._get_flush_denormal``), but it sets the x86
    MXCSR DAZ/FTZ bits of the calling thread, which Python's float arithmetic obeys too."""
    return _TINY * 1.0 == 0.0


_PRINT_OPTS = torch._tensor_str.PRINT_OPTS
_ROOT = logging.getLogger()
_SIGNALS = sorted(signal.valid_signals())
_PATH_COPY = list(sys.path)
_STDOUT, _STDERR = sys.stdout, sys.stderr


def _umask() -> int:
    old = os.umask(0)  # no getter before Python 3.13: set and put back (two syscalls, racy)
    os.umask(old)
    return old


CANDIDATES: list[tuple[str, Callable[[], Any]]] = [
    ("os.getcwd()", os.getcwd),
    ("sys.path == copy", lambda: sys.path == _PATH_COPY),
    ("sys.getrecursionlimit()", sys.getrecursionlimit),
    ("signal.getsignal(SIGINT)", lambda: signal.getsignal(signal.SIGINT)),
    ("signal.getsignal(every signal)", lambda: [signal.getsignal(s) for s in _SIGNALS]),
    ("_signal.getsignal(every signal) (no enum conversion)", lambda: [_signal.getsignal(s) for s in _SIGNALS]),
    ("os.umask (set and put back)", _umask),
    ("sys.stdout is / sys.stderr is", lambda: (sys.stdout is _STDOUT, sys.stderr is _STDERR)),
    ("flush denormal (float probe)", _flush_denormal_probe),
    ("torch.is_anomaly_enabled()", torch.is_anomaly_enabled),
    ("torch.is_anomaly_check_nan_enabled()", torch.is_anomaly_check_nan_enabled),
    ("torch._tensor_str.PRINT_OPTS (vars)", lambda: tuple(vars(_PRINT_OPTS).values())),
    ("torch.get_default_device()", torch.get_default_device),
    ("torch._C._len_torch_function_stack()", torch._C._len_torch_function_stack),
    ("torch._C._get_deterministic_algorithms_warn_only()", torch._C._get_deterministic_algorithms_warn_only),
    ("torch._C._get_deterministic_fill_uninitialized_memory()",
     torch._C._get_deterministic_fill_uninitialized_memory),
    ("torch._C._get_mkldnn_enabled()", torch._C._get_mkldnn_enabled),
    ("torch._C._get_mkldnn_deterministic()", torch._C._get_mkldnn_deterministic),
    ("torch._C._get_nnpack_enabled()", torch._C._get_nnpack_enabled),
    ("torch._C._get_cudnn_enabled()", torch._C._get_cudnn_enabled),
    ("torch._C._get_cpu_allow_fp16_reduced_precision_reduction()",
     torch._C._get_cpu_allow_fp16_reduced_precision_reduction),
    ("torch._C._get_onednn_allow_tf32()", torch._C._get_onednn_allow_tf32),
    ("torch._C._get_linalg_preferred_backend()", torch._C._get_linalg_preferred_backend),
    ("torch._C._get_blas_preferred_backend()", torch._C._get_blas_preferred_backend),
    ("torch.backends.opt_einsum.enabled", lambda: torch.backends.opt_einsum.enabled),
    ("torch._C._get_warnAlways()", torch._C._get_warnAlways),
    ("logging root (level, handlers, disable)",
     lambda: (_ROOT.level, len(_ROOT.handlers), _ROOT.manager.disable)),
    ("sys.getswitchinterval()", sys.getswitchinterval),
    ("gc.isenabled()", gc.isenabled),
    ("gc.get_threshold()", gc.get_threshold),
    ("torch.get_num_threads() (audited: reference)", torch.get_num_threads),
]

# how a hook changes each (for the thread test): name -> (change, undo)
CHANGES: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "flush denormal (float probe)": (lambda: torch.set_flush_denormal(True), lambda: torch.set_flush_denormal(False)),
    "torch.get_default_device()": (lambda: torch.set_default_device("meta"), lambda: torch.set_default_device(None)),
    "torch._C._len_torch_function_stack()": (lambda: torch.set_default_device("meta"),
                                             lambda: torch.set_default_device(None)),
    "torch.is_anomaly_enabled()": (lambda: torch.set_anomaly_enabled(True), lambda: torch.set_anomaly_enabled(False)),
    "sys.getrecursionlimit()": (lambda: sys.setrecursionlimit(5000), lambda: sys.setrecursionlimit(1000)),
    "torch._C._get_deterministic_algorithms_warn_only()": (
        lambda: torch.use_deterministic_algorithms(True, warn_only=True),
        lambda: torch.use_deterministic_algorithms(False)),
}


def _seen_by_an_older_thread(name: str, get: Callable[[], Any]) -> bool:
    """Change the value on this thread; does a thread started *before* the change see it?"""
    change, undo = CHANGES[name]
    go, seen = threading.Event(), []
    thread = threading.Thread(target=lambda: (go.wait(), seen.append(get())))
    thread.start()
    before = get()
    change()
    try:
        go.set()
        thread.join()
    finally:
        undo()
    return seen[0] != before


def _first_imports_change() -> set[str]:
    """Which candidates one ``AdamW.step()`` (torch's lazy imports) changes."""
    before = {name: repr(get()) for name, get in CANDIDATES if "signal" not in name and "umask" not in name}
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    torch.optim.AdamW([param]).step()
    return {name for name, get in CANDIDATES if name in before and repr(get()) != before[name]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=200_000)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {os.uname().machine}")
    modules = len(sys.modules)
    changed = _first_imports_change()
    print(f"AdamW.step() imported {len(sys.modules) - modules} modules; changed: {sorted(changed) or 'none'}")
    for name, get in CANDIDATES:
        number = max(args.number // (100 if "every signal" in name or "umask" in name else 1), 1000)
        ns = min(timeit.repeat(get, number=number, repeat=5)) / number * 1e9
        reach = ""
        if name in CHANGES:
            reach = "process-wide" if _seen_by_an_older_thread(name, get) else "thread-local"
        print(f"{ns:10.0f} ns  {name:60s} {reach}")


if __name__ == "__main__":
    main()
