"""The run directory: its files, who writes them, and what they say about the run.

`layout` names every file once; `durable` is the durable-write primitive; `writer` is the
single writer, with its lease lock (`lock`, `lease`). `checkpoint` keeps the checkpoints,
`state` the run record, `ends` how the ranks ended, `liveness` the nodes' heartbeats and a
hang's record, `progress` the iterations and `snapshot` the code the run runs. `writer` and
`checkpoint` import torch when a checkpoint is written.
"""
