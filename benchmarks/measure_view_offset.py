"""Real DDP (gloo, world 1), gradient_as_bucket_view=True: p.grad's storage offset and
stride after backward, iterations 0 and 1 (rebuild)."""
import os
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("gloo", rank=0, world_size=1)
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.a = torch.nn.Parameter(torch.ones(4, 5)); self.b = torch.nn.Parameter(torch.ones(5))
    def forward(self, x):
        return (self.a * x).sum() + (self.b * x[0]).sum()
ddp = DDP(M(), gradient_as_bucket_view=True)
for it in range(3):
    ddp(torch.ones(4, 5)).backward()
    print(it, [(tuple(p.grad.stride()), p.grad.storage_offset(), p.grad.untyped_storage().nbytes()) for p in ddp.module.parameters()])
    ddp.zero_grad(set_to_none=True)
dist.destroy_process_group()
