"""The deterministic engine: drives every rank's code inline on one thread (``inline``) or on
threads for the real reducer (``threaded``), the seeded ``scheduler`` that picks which ready
collective completes next, the event ``trace``, and ``frames`` (which stack frames are user code).
It knows no torch: it speaks of ranks, posted operations and waitables.
"""
