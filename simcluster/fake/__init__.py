"""The fake torch parts, adapters on top of the engine: ``process_group`` (a ``ProcessGroup`` whose
collectives compute the true results), ``futures`` (``torch.futures.Future`` / ``Work`` look-alikes
completed by the engine), ``bucket`` (``GradBucket``), ``collectives`` (pure semantics: reduce
ops, reduction order per backend), ``backends`` (gloo and NCCL models), ``rank_context`` (what
switches with the rank), ``reducer`` (DDP's reducer as a hook meets it: the result contract, the
copy-back), ``cluster`` (``SimCluster``) and ``state`` (the hook-state spec).
"""
