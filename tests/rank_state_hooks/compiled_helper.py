"""A hook whose helper is ``torch.compile``d at import (as a quantising hook from the wild
does): Dynamo keeps the compiled code on the helper's code object and installs the names
its bytecode loads in the globals of the module copy that ran it first."""

import torch
import torch.distributed as dist


def _halve(t: torch.Tensor) -> torch.Tensor:
    return t * 0.5


_halve_compiled = torch.compile(_halve, backend="eager")


def hook(state, bucket):
    buf = _halve_compiled(bucket.buffer())  # the mean of 2 ranks (world 2 in the test)
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])
