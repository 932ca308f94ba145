"""A module that ends the process while it is imported."""
import sys

sys.exit(0)


def hook(state, bucket):
    raise AssertionError("never reached")
