"""A state factory for tests/test_differential.py, named by module or by file (the gloo
children import it by that name; each simulated rank may load its own copy)."""

from __future__ import annotations

from typing import Any


def group_state(process_group: Any) -> Any:
    """The rank's process group, as state ``"group"`` gives it (``allreduce_hook``'s state)."""
    return process_group
