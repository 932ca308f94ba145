"""At import, ignores SIGINT (Ctrl-C) for its whole process; the hook says it runs, then spins."""
import os
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)


def hook(state, bucket):
    folder = os.environ.get("SIMCLUSTER_TEST_STARTED")
    if folder:
        open(os.path.join(folder, "spins"), "w").close()
    while True:  # spins here
        pass
