"""Test-suite set-up shared by every test.

* One intra-op thread per test process: ``pytest -n auto`` already runs one worker per
  core, and simulated ranks are one process anyway.
* Hypothesis profiles come from simcluster's pytest plugin (``ci`` when the ``CI``
  environment variable is set: derandomized, no deadline).
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
