"""The run directory: its layout (`layout`: every file name once), the durable-write primitive
(`durable`), the single writer (`writer`) and its lease lock (`lock`, `lock_files`),
checkpoints (`checkpoint`) and the run record (`record`).

Only the light modules are re-exported here; `writer` and `checkpoint` import torch.
"""

from mjlab_hpc.rundir.layout import RunDir, create_run_dir, latest_run, run_dir_for_key
from mjlab_hpc.rundir.lock import (
    LeaseLock,
    LockError,
    LockLost,
    LockTimeout,
    OwnerInfo,
    write_fenced,
)

__all__ = [
    "LeaseLock",
    "LockError",
    "LockLost",
    "LockTimeout",
    "OwnerInfo",
    "RunDir",
    "create_run_dir",
    "latest_run",
    "run_dir_for_key",
    "write_fenced",
]
