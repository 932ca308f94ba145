"""Code under test, treated as a process would: ``targets`` (load ``module:attr`` / ``file.py:attr``),
``rank_local`` (each rank's own copy of the user's modules), ``rank_state`` (each rank's
Python/numpy RNG and process-wide settings), ``output`` (what it prints, captured) and
``stand_in`` (simcluster's callables in the hook's place, which look like the hook to DDP).
"""
