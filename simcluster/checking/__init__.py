"""Checking: ``strategies`` (Hypothesis draws), ``properties`` (the oracles), ``tolerances``,
``check`` (the Hypothesis driver and ``check_hook``), ``options`` (validated arguments),
``judge`` (one example through the oracles), ``replay`` (the replay-token codec),
``supervisor`` (runs a search in a child it can always end), ``report``/``render`` (what a failure says), ``training``/``train_check`` (multi-step runs),
``defaults`` (the embedded default run) and ``progress``.
"""
