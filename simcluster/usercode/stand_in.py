"""A callable that stands in for the user's hook and looks like it to whoever inspects it.

simcluster puts its own callable where the user's hook would go — a rank's own copy of
the hook's module (:class:`~simcluster.usercode.rank_local.RankLocal`), a recorder of hook
calls handed to real DDP (:mod:`simcluster.real.e2e`, :mod:`simcluster.ddp.real_ddp`). Real
DDP's ``register_comm_hook`` inspects what it is given (``docs/ddp-facts.md``,
*Registration (measured)*): its signature (a parameter named ``bucket``, the annotations),
then ``hook.__name__`` and ``hook.__qualname__``. A ``functools.partial`` and a callable
class instance have neither, and registration raises ``AttributeError``.

A function made with ``functools.wraps`` always has a ``__name__`` of its own, so real DDP
would register through it a hook it refuses as the user wrote it (and a wrapper copying a
missing name as ``None`` fails with another error, a ``TypeError``). A :class:`StandIn`
has exactly the identity of the hook it stands for: its ``__module__``, ``__name__``,
``__qualname__`` and ``__doc__`` where the hook has them; reading one the hook lacks raises
the hook's own ``AttributeError`` (``'functools.partial' object has no attribute
'__name__'``); ``inspect.signature`` follows ``__wrapped__`` to the hook's.

>>> import functools
>>> def hook(state, bucket): ...
>>> functools.partial(hook).__name__
Traceback (most recent call last):
AttributeError: 'functools.partial' object has no attribute '__name__'
>>> stand_in(functools.partial(hook), print).__name__
Traceback (most recent call last):
AttributeError: 'functools.partial' object has no attribute '__name__'
>>> stand_in(hook, print).__name__
'hook'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["StandIn", "stand_in", "IDENTITY"]

IDENTITY = ("__module__", "__name__", "__qualname__", "__doc__")
"""What a stand-in copies from the hook (the attributes ``functools.wraps`` assigns)."""

_NAMES = ("__name__", "__qualname__")
"""Attributes no instance has unless given: looked up on the hook when the hook lacks them."""


class StandIn:
    """Carries ``hook``'s identity (:data:`IDENTITY`, ``__wrapped__``); a subclass calls it."""

    def __init__(self, hook: Any) -> None:
        self.__wrapped__ = hook
        for name in IDENTITY:
            try:
                setattr(self, name, getattr(hook, name))
            except AttributeError:
                pass  # as the hook: reading it raises (``__getattr__``)

    def __getattr__(self, name: str) -> Any:
        # only reached for what the instance and its class lack: a name the hook lacks too
        hook = self.__dict__.get("__wrapped__")
        if name in _NAMES and hook is not None:
            return getattr(hook, name)  # raises the hook's own AttributeError
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class _Calling(StandIn):
    def __init__(self, hook: Any, call: Callable[..., Any]) -> None:
        super().__init__(hook)
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


def stand_in(hook: Any, call: Callable[..., Any]) -> Callable[..., Any]:
    """``call``, looking like ``hook`` (:class:`StandIn`): what to hand real DDP in place of
    the hook, where ``functools.wraps(hook)(call)`` would give a name the hook lacks."""
    return _Calling(hook, call)
