"""The DDP model: ``model`` (the simulated DDP step: buckets, rebuild after iteration 0, hook
calls, copy-back), ``layout`` (DDP's bucket assignment) and ``real_ddp`` (torch's real C++ reducer run on simulated groups).
"""
