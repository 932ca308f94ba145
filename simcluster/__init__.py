"""simcluster: run real DDP communication hooks on N simulated ranks in one process."""

from simcluster.errors import SimClusterError

__all__ = ["SimClusterError"]
