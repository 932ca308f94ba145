"""The replay codec: a counterexample as a token that reruns it bit for bit.

Every failure :func:`~simcluster.checking.check.check_hook` reports carries a token
``sc1.<base64url(zlib(JSON of the Example, plus the backend))>``: the concrete
counterexample, not Hypothesis' internal choice sequence, so it survives Hypothesis
upgrades. The example includes the seed of the ranks' torch, ``random`` and numpy
generators (``Example.rng_seed``); a token made before that field existed replays with
``--seed``, as it did then; a rank's ``nonfinite`` values (the explicit non-finite
examples only) are written only when there are some. ``check_hook(..., replay=token)`` (CLI: ``--replay TOKEN``)
runs exactly that example once.

    >>> from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec
    >>> ex = Example(2, Layout(((3,),), None, (0,)), StepSpec((RankSpec("const"),) * 2), (0, 0))
    >>> token = encode_example(ex, "gloo")
    >>> token.startswith(TOKEN_PREFIX), decode_example(token) == (ex, "gloo")
    (True, True)

The example dataclasses themselves live with the strategies that draw them
(:mod:`simcluster.checking.strategies`), since :meth:`Example.grads` materialises them there.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from typing import Any

from simcluster.checking.strategies import Example, Layout, RankSpec, StepSpec
from simcluster.errors import UsageError

__all__ = ["TOKEN_PREFIX", "encode_example", "decode_example", "DeferredToken"]

TOKEN_PREFIX = "sc1."


def encode_example(example: Example, backend: str) -> str:
    """The replay token of ``example`` on ``backend`` (see the module docstring)."""
    data = {"backend": backend, "example": dataclasses.asdict(example)}
    if example.rng_seed is None:  # tokens of examples without drawn RNG seeds read as before
        del data["example"]["rng_seed"]
    for rank in data["example"]["base"]["ranks"]:  # likewise ranks without non-finite values
        if not rank["nonfinite"]:
            del rank["nonfinite"]
    raw = json.dumps(data, separators=(",", ":"), sort_keys=True).encode()
    return TOKEN_PREFIX + base64.urlsafe_b64encode(zlib.compress(raw, 9)).decode().rstrip("=")


class DeferredToken:
    """``encode_example(example, backend)``, encoded only where it is read: pickled, it is the
    example (~30 µs); unpickled, it is the token string (~250 µs of ``dataclasses.asdict``,
    JSON and zlib). A supervised child announces every example it starts with one
    (:meth:`~simcluster.checking.supervisor.Monitor.begin`), and its parent unpickles the
    announcement only when the child died or hung in that example: the replay token of the
    one example reported, not of the thousands that ended (1.5 % of the default check)."""

    __slots__ = ("example", "backend")

    def __init__(self, example: Example, backend: str) -> None:
        self.example, self.backend = example, backend

    def __reduce__(self) -> tuple[Any, tuple[Example, str]]:
        return encode_example, (self.example, self.backend)


def decode_example(token: str) -> tuple[Example, str]:
    """``(example, backend)`` from a replay token; UsageError if it is not one."""
    try:
        if not token.startswith(TOKEN_PREFIX):
            raise ValueError("no sc1. prefix")
        body = token[len(TOKEN_PREFIX):]
        data = json.loads(zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))
        ex = data["example"]
        layout = Layout(**{**ex["layout"], "shapes": tuple(tuple(s) for s in ex["layout"]["shapes"]),
                           "ready_order": tuple(ex["layout"]["ready_order"])})
        b = ex["base"]
        base = StepSpec(ranks=tuple(RankSpec(r["fill"], r["exp"], r["seed"], r["value"],
                                             tuple((p, v) for p, v in r["specials"]), r["zero"],
                                             tuple((p, v) for p, v in r.get("nonfinite", ()))) for r in b["ranks"]),
                        shared=tuple((p, v) for p, v in b["shared"]), exp=b["exp"], shift=b["shift"])
        example = Example(ex["world_size"], layout, base, tuple(ex["shifts"]), tuple(ex["schedule"]), ex["dtype"],
                          ex["values"], ex["exact"], ex["subgroups"], ex.get("rng_seed"))
        return example, data["backend"]
    except Exception as exc:  # noqa: BLE001 - any malformation is the caller's
        raise UsageError(f"--replay {token[:40]!r}…: not a simcluster replay token ({exc})") from None
