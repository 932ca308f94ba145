"""A library that, when first imported, sets a warnings filter and an environment variable
(as torch's lazy imports do on the first optimizer step: sympy's filter, inductor's cache
dir): every process importing it does the same, so no rank owns the change."""
import os
import warnings


class LazyLibWarning(UserWarning):
    pass


warnings.filterwarnings("once", category=LazyLibWarning)
os.environ.setdefault("SIMCLUSTER_TEST_LAZY_LIB_DIR", "/tmp/lazy-lib")
