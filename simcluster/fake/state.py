"""A hook's state for one rank: ``None``, the rank's process group, or what a factory builds.

A state *factory* is called once per rank, in that rank's context, with the process
group DDP runs on for that rank (the world's, or the rank's subgroup). Many real states
are built from the model too — a sketch sized from the parameters, per-parameter
residuals, PowerSGD with a model-specific rank — so a factory may also take the model::

    def make_state(process_group):                 # called as make_state(group)
        ...
    def make_sketch_state(process_group, model):   # called as make_sketch_state(group, model)
        return SketchState(process_group, {p: torch.zeros(...) for p in model.parameters()})

``model`` is a :class:`torch.nn.Module` whose ``parameters()`` are exactly the Parameter
objects DDP hands to ``bucket.parameters()`` on that rank, in DDP's order and shapes.
Under :class:`~simcluster.ddp.model.SimDDP` it is a :class:`LayoutModel` (parameters only);
under :func:`~simcluster.ddp.real_ddp.run_real_ddp` it is the rank's real module.

Which factories get the model (:func:`wants_model`): those whose second parameter has no
default, or that have a parameter named ``model``. So ``TopKState(process_group=None,
ratio=0.25)`` and ``PowerSGDState(process_group, matrix_approximation_rank=1, …)`` are
called with the group alone, as before.

    >>> wants_model(lambda pg: None), wants_model(lambda pg, model: None), wants_model(lambda pg, k=4: None)
    (False, True, False)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from simcluster.errors import UnsupportedError, UsageError

__all__ = ["LayoutModel", "wants_model", "make_state"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class LayoutModel(torch.nn.Module):
    """A rank's model as far as DDP's buckets see it: its parameters, in order, named ``p0``, ``p1``, …

    It has no ``forward``: simcluster feeds gradients, not inputs.
    """

    def __init__(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        super().__init__()
        for i, p in enumerate(parameters):
            self.register_parameter(f"p{i}", p)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedError("simcluster's LayoutModel holds parameters only; it has no forward")


def wants_model(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` takes ``(process_group, model)`` (see the module docstring)."""
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the one-argument form
        return False
    if any(p.name == "model" and p.kind != inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    positional = [p for p in params if p.kind in _POSITIONAL]
    return len(positional) >= 2 and positional[1].default is inspect.Parameter.empty


def make_state(spec: Any, group: Any, model: Callable[[], torch.nn.Module] | torch.nn.Module) -> Any:
    """Rank state from a spec: ``None``; ``"group"`` (the group itself); or a factory's result.

    ``model``: the rank's module, or a function building it (called only when the
    factory takes one).
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec == "group":
            return group
        raise UsageError(f"state={spec!r} is not a state spec: use None, 'group' or a factory")
    if not callable(spec):
        raise UsageError(f"state={spec!r} (type={type(spec).__name__}) is not a state spec")
    if not wants_model(spec):
        return spec(group)
    module = model if isinstance(model, torch.nn.Module) else model()
    named = any(p.name == "model" and p.kind == inspect.Parameter.KEYWORD_ONLY
                for p in inspect.signature(spec).parameters.values())
    return spec(group, model=module) if named else spec(group, module)
