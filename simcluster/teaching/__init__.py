"""Teaching: ``explain`` (``simcluster explain``), ``story`` (a step told in words), ``wire``
(bytes on the wire), ``timeline`` and ``chrome_trace`` (what ran when), ``safe_range``.
"""
