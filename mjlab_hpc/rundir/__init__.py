"""The run directory: its layout (`layout`: every file name once), the durable-write primitive
(`durable`), the single writer (`writer`) and its lease lock (`lock`, `lease`), checkpoints
(`checkpoint`), the run's state and how it ended (`state`), progress (`progress`) and the code
it runs (`snapshot`). `writer` and `checkpoint` import torch when a checkpoint is written."""
