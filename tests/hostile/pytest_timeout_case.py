"""Run by tests/test_hostile.py in a separate pytest with --timeout: a hung hook checked from a test."""
from pathlib import Path

from simcluster.plugin import assert_hook

HOOKS = str(Path(__file__).with_name("hooks.py"))


def test_hung_hook_is_reported():
    assert_hook(HOOKS + ":sleeps", world_sizes=(2,), backends=("gloo",), examples=3, database=None)


def test_hung_hook_is_reported_through_the_fixture(simcluster_assert):
    """The fixture is set up before the test's call: it must read pytest-timeout's limit itself."""
    simcluster_assert(HOOKS + ":sleeps", world_sizes=(2,), backends=("gloo",), examples=3)
