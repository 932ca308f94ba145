"""A module whose import never ends (a TARGET's module code runs when it is loaded)."""
while True:
    pass


def hook(state, bucket):
    raise AssertionError("never reached")
