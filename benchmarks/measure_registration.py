"""Measure which callables real ``DistributedDataParallel.register_comm_hook`` refuses, and how.

Real DDP (torch 2.13, CPU) on a real one-rank gloo group (a FileStore in a private temp
dir), a fresh ``DDP(Linear(2, 1))`` per case. Each case registers one callable; if
registration succeeds, one ``forward``/``backward`` is run to see whether the hook is
then usable. Prints one line per case: what registration did, then what ``backward`` did.

The hooks carry no annotations (an annotation other than ``dist.GradBucket`` /
``torch.futures.Future[torch.Tensor]`` is refused first, with ValueError).

Run: python benchmarks/measure_registration.py   (docs/ddp-facts.md, "Registration (measured)")
"""

import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def echo(state, bucket):
    """A plain hook: resolves to the bucket's own (local) gradients."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def echo_with_scale(scale: float, state, bucket):
    """A hook with one more leading parameter, for functools.partial to bind."""
    return echo(state, bucket)


class CallableHook:
    """An instance of this class is a hook (``__call__``)."""

    def __call__(self, state, bucket):
        return echo(state, bucket)


class Holder:
    """A class whose method is a hook (registered bound: ``Holder().hook``)."""

    def hook(self, state, bucket):
        return echo(state, bucket)

    @staticmethod
    def static_hook(state, bucket):
        return echo(state, bucket)


def one_param(bucket):
    return echo(None, bucket)


def three_params(state, bucket, extra):
    return echo(state, bucket)


def no_bucket(state, grad_bucket):
    return echo(state, grad_bucket)


def _named(obj: Any, **attrs: Any) -> Any:
    for key, value in attrs.items():
        setattr(obj, key, value)
    return obj


class _NamedNone(CallableHook):
    """A callable instance whose ``__name__`` and ``__qualname__`` are None."""

    def __init__(self) -> None:
        self.__name__ = None
        self.__qualname__ = None


CASES: dict[str, Any] = {
    "plain function": echo,
    "lambda": lambda state, bucket: echo(state, bucket),
    "functools.partial(echo)": functools.partial(echo),
    "functools.partial(echo_with_scale, 2.0)": functools.partial(echo_with_scale, 2.0),
    "functools.partial with __name__ set": _named(functools.partial(echo), __name__="echo"),
    "functools.partial with __name__ and __qualname__ set": _named(functools.partial(echo), __name__="echo",
                                                                   __qualname__="echo"),
    "callable class instance": CallableHook(),
    "callable class instance with __name__ set": _named(CallableHook(), __name__="hook"),
    "callable class instance with __name__ and __qualname__ set": _named(CallableHook(), __name__="hook",
                                                                         __qualname__="hook"),
    "callable instance whose __name__ and __qualname__ are None": _NamedNone(),
    "callable instance whose __name__ is None, __qualname__ a str": _named(CallableHook(), __name__=None,
                                                                           __qualname__="hook"),
    "bound method": Holder().hook,
    "staticmethod": Holder.static_hook,
    "functools.wraps wrapper of a partial": functools.wraps(functools.partial(echo))(
        lambda state, bucket: echo(state, bucket)),
    "wrong arity: hook(bucket)": one_param,
    "wrong arity: hook(state, bucket, extra)": three_params,
    "wrong name: hook(state, grad_bucket)": no_bucket,
}


def _outcome(call: Any) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the measurement
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return "ok"


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="measure_registration_"))
    try:
        store = dist.FileStore(str(folder / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        print(f"torch {torch.__version__}, gloo, world 1")
        for name, hook in CASES.items():
            torch.manual_seed(0)
            model = DDP(torch.nn.Linear(2, 1))
            registered = _outcome(lambda: model.register_comm_hook(None, hook))
            ran = _outcome(lambda: model(torch.ones(1, 2)).sum().backward()) if registered == "ok" else "-"
            print(f"{name}: register_comm_hook -> {registered}; backward -> {ran}")
        dist.destroy_process_group()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
