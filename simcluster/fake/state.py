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

**The state spec** — what a caller writes for ``state=`` — is parsed once, by
:meth:`StateSpec.parse`, and resolved per rank with :meth:`StateSpec.resolve`. Its kinds:

=========================  ===================================================================
``None`` / ``"none"``      no state: the hook gets ``None`` (torch's hooks then use ``dist.group.WORLD``)
``"group"``                the rank's process group (the world's, or the rank's DDP subgroup)
a callable                 a factory, ``factory(group)`` or ``factory(group, model)``, once per rank
``"module:factory"``       a factory loaded by the caller's ``load`` (the CLI's spellings,
``"file.py:factory"``      :mod:`simcluster.usercode.targets`); refused where no loader is given
=========================  ===================================================================

    >>> StateSpec.parse(None).kind, StateSpec.parse("group").name
    ('none', 'group')
    >>> StateSpec.parse(lambda pg: 7).resolve("pg")
    7
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from simcluster.errors import UnsupportedError, UsageError
from simcluster.names import loadable_spec

__all__ = ["LayoutModel", "StateSpec", "wants_model"]

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


StateKind = Literal["none", "group", "factory"]

_KINDS = "use 'none', 'group', 'module:factory', 'file.py:factory' or a callable factory(process_group)"


@dataclass(frozen=True)
class StateSpec:
    """A hook-state spec, parsed once: its ``kind``, the ``factory`` (for ``"factory"``), and
    its ``name`` as written in reports, replay lines and example-database keys
    (``"none"``, ``"group"``, the spec string, or the factory's ``module:qualname``).
    """

    kind: StateKind
    factory: Callable[..., Any] | None = None
    name: str = "none"

    @classmethod
    def parse(cls, spec: Any, *, load: Callable[[str], Callable[..., Any]] | None = None,
              name: str | None = None) -> StateSpec:
        """The :class:`StateSpec` for ``spec`` (a :class:`StateSpec` is returned as it is).

        ``load`` turns a ``"module:factory"`` / ``"file.py:factory"`` string into the factory
        (e.g. :func:`~simcluster.usercode.targets.load_target`, or a per-rank
        :class:`~simcluster.usercode.rank_local.RankLocal`); without it such a string is
        refused. ``name`` overrides the factory's name (a ``RankLocal`` goes by its spec).
        A bad spec is a one-line :class:`~simcluster.errors.UsageError` quoting it; ``load``'s
        own errors (:class:`~simcluster.errors.TargetLoadError`) propagate.
        """
        if isinstance(spec, StateSpec):
            return spec
        if spec is None or (isinstance(spec, str) and spec == "none"):
            return _NONE if cls is StateSpec else cls("none")  # frozen: one shared instance (made per step: hot)
        if isinstance(spec, str) and spec == "group":
            return _GROUP if cls is StateSpec else cls("group", name="group")
        if isinstance(spec, str):
            if load is None:
                raise UsageError(f"state={spec!r} is not a state spec here: use None, 'group' or a factory")
            return cls("factory", load(spec), name or spec)
        if callable(spec):
            return cls("factory", spec, name or loadable_spec(spec) or "<factory>")
        raise UsageError(f"state={spec!r} (type={type(spec).__name__}) is not a state spec: {_KINDS}")

    def resolve(self, group: Any, model: Callable[[], torch.nn.Module] | torch.nn.Module | None = None) -> Any:
        """One rank's state: ``None``, ``group``, or the factory's result for ``group``.

        ``model``: the rank's module, or a function building it (called only when the
        factory takes one, :func:`wants_model`); ``None`` where there is none to give.
        """
        if self.kind == "none":
            return None
        if self.kind == "group":
            return group
        assert self.factory is not None
        form = _call_form(self.factory)
        if form == "group":
            return self.factory(group)
        if model is None:
            raise UsageError(f"state factory {self.name} takes (process_group, model); here there is no model to give it")
        module = model if isinstance(model, torch.nn.Module) else model()
        return self.factory(group, model=module) if form == "keyword" else self.factory(group, module)


def _call_form(factory: Callable[..., Any]) -> str:
    """How :meth:`StateSpec.resolve` calls ``factory``: ``"group"`` (``factory(group)``),
    ``"positional"`` (``factory(group, model)``) or ``"keyword"`` (``factory(group, model=model)``:
    ``model`` is keyword-only). Worked out once per factory while it lives: reading a
    signature costs ~50 µs, and a state is resolved once per rank and run."""
    try:
        return _FORMS[factory]
    except (KeyError, TypeError):  # TypeError: a factory that takes no weak reference
        pass
    if not wants_model(factory):
        form = "group"
    else:
        keyword = any(p.name == "model" and p.kind == inspect.Parameter.KEYWORD_ONLY
                      for p in inspect.signature(factory).parameters.values())
        form = "keyword" if keyword else "positional"
    try:
        _FORMS[factory] = form
    except TypeError:
        pass
    return form


_FORMS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
""":func:`_call_form`'s answers, forgotten with their factory (a lambda made per call is not kept)."""


_NONE = StateSpec("none")
_GROUP = StateSpec("group", name="group")
