"""Measure how real DDP's GradBucket is named in the TypeErrors a misused bucket raises inside
a hook (real DDP, gloo, world 1): dist.all_reduce(bucket), bucket[0], bucket / 2, len(bucket).
Run: python benchmarks/measure_bucket_type_errors.py  (docs/ddp-facts.md §1)."""
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("gloo", rank=0, world_size=1)
msgs = {}
def make(kind):
    def hook(state, bucket):
        try:
            if kind == "all_reduce":
                dist.all_reduce(bucket)
            elif kind == "subscript":
                bucket[0]
            elif kind == "div":
                bucket / 2
            elif kind == "len":
                len(bucket)
        except Exception as e:
            msgs[kind] = f"{type(e).__name__}: {e}"
        f = torch.futures.Future(); f.set_result(bucket.buffer()); return f
    return hook
for kind in ["all_reduce", "subscript", "div", "len"]:
    m = DDP(torch.nn.Linear(2, 1))
    m.register_comm_hook(None, make(kind))
    m(torch.ones(1, 2)).sum().backward()
for k, v in msgs.items():
    print(k, "->", repr(v))
dist.destroy_process_group()
