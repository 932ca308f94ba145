"""The engine: drives every rank's code inline on one thread (``inline``) or on threads for
the real reducer (``threaded``). Both implement one contract (``contract``: ``EngineContract``,
``Waitable``, ``Call``) and match posted calls with one matcher (``matching``). The baton
engine's parts: ``slots`` (the OS threads it parks and wakes), ``guard`` (which threads are
ranks, which exceptions mean stop), ``blockage`` (the deadlock report). Beside them: the seeded
``scheduler`` that picks which ready collective completes next, the event ``trace``, and
``frames`` (which stack frames are user code). It knows no torch: it speaks of ranks, posted
operations and waitables.
"""
