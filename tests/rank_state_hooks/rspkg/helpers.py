"""Module state the hook relies on: one call counter per process."""

calls = {"n": 0}


def bump() -> int:
    calls["n"] += 1
    return calls["n"]
