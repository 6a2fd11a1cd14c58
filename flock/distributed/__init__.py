"""Scale-out: one batch job over many engines, sharded by prefix group.

`partition` (no Ray) assigns whole prefix groups to workers; `driver` runs a `flock run` job on Ray actors
(`worker`), one engine each; `data` is a Ray Data processor. The Ray modules import `ray` (the `ray` extra).
"""

from flock.distributed.partition import Partition, partition

__all__ = ["Partition", "partition"]
