"""Communication hooks written for simcluster: references, a catalogue of bugs, legacy-style hooks.

* :mod:`simcluster.hooks.reference` — correct hooks on the current API (mean, fp16/bf16, all_gather,
  scaled fp16, top-k with error feedback).
* :mod:`simcluster.hooks.buggy` — one realistic buggy hook per bug class, each docstring teaching the bug.
* :mod:`simcluster.hooks.legacy` — hooks in the PyTorch 1.7 – 1.9 style (``[tensor]`` results).
* :mod:`simcluster.hooks.catalogue` — all of them as plain data (:func:`entries`) for checkers and tests.

This package is user-style code: it imports torch, never simcluster.
"""

from simcluster.hooks.catalogue import BUGGY, LEGACY, REFERENCE, CatalogueEntry, by_name, entries

__all__ = ["CatalogueEntry", "REFERENCE", "BUGGY", "LEGACY", "entries", "by_name"]
