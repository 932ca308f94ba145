"""Run by tests/test_hostile.py in a separate pytest with --timeout: a hung hook checked from a test."""
from pathlib import Path

from simcluster.plugin import assert_hook

HOOKS = str(Path(__file__).with_name("hooks.py"))


def test_hung_hook_is_reported():
    assert_hook(HOOKS + ":sleeps", world_sizes=(2,), backends=("gloo",), examples=3, database=None)


def test_hung_hook_in_process(sim_cluster):
    import torch
    import hooks

    sim_cluster.run_hook(hooks.spins, [torch.ones(2), torch.ones(2)])
