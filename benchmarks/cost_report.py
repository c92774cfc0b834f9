"""`mjlab-hpc report --out` of a long run: seconds and peak memory against the run's length.

Builds a synthetic local run directory (N iterations of 2 ranks, a checkpoint after each, a heal
every 100 iterations) and times `collect_report` and `draw_timeline` on it:

    python -m benchmarks.cost_report --iterations 2000 10000
"""

from __future__ import annotations

import datetime as dt
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["make_run", "measure"]

# The run's first second: what its name (2026-01-01_00-00-00) says.
T0 = dt.datetime(2026, 1, 1).timestamp()


def make_run(path: Path, iterations: int, save_every: int = 10, heal_every: int = 1000) -> Path:
    """A local run of `iterations` 1-s iterations of 2 ranks, healed every `heal_every`."""
    from mjlab_hpc.rundir.record import Interruption, RunRecord, Start

    ranks = path / "logs" / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    starts = list(range(0, iterations, heal_every))
    faults = []
    progress, saves = [], []
    at = T0 + 5.0  # the launcher's start-up
    for n, first in enumerate(starts, start=1):
        at += 5.0  # start-up
        for rank in (0, 1):
            record = {"run": path.name, "rank": rank, "world_size": 2, "node": "here"}
            record.update(pid=100 + rank, device="cpu", at=at)
            (ranks / f"rank{rank}.{n}.start.json").write_text(json.dumps(record))
        last = min(first + heal_every, iterations)
        for i in range(first + 1, last + 1):
            at += 1.0
            progress.append({"iteration": i, "env_steps": 1024, "collect_s": 0.7, "learn_s": 0.2})
            progress[-1]["time"] = at
            if i % save_every == 0:
                saves.append({"iteration": i, "at": at, "s": 0.1})
                at += 0.1
        how = "completed" if last == iterations else "failed"
        end = {"how": how, "detail": how, "at": at + 1}
        for rank in (0, 1):
            (ranks / f"rank{rank}.{n}.end.json").write_text(json.dumps(end))
        if last < iterations:
            faults.append(
                Interruption(
                    reason="crash", kind="in-allocation", iteration=last, at_s=at + 1, recomputed=0
                )
            )
    record = RunRecord(
        launch_mode="submitit-local",
        starts=tuple(Start() for _ in starts),
        faults=tuple(faults),
        world_size=2,
        num_nodes=1,
        device="cpu",
        state="completed",
    )
    (path / "run.json").write_text(json.dumps(record.to_json()))
    (path / "progress.jsonl").write_text("".join(json.dumps(p) + "\n" for p in progress))
    (path / "logs" / "checkpoints.jsonl").write_text("".join(json.dumps(s) + "\n" for s in saves))
    return path


def measure(iterations: int) -> tuple[float, float]:
    """Seconds of `report --out` (collect and draw) of a run of `iterations`, and the peak
    RSS of this process afterwards (MiB; one size per process gives the true peak)."""
    from mjlab_hpc.ops.report import collect_report, draw_timeline

    with tempfile.TemporaryDirectory() as tmp:
        run = make_run(Path(tmp) / "2026-01-01_00-00-00", iterations, 1, 100)
        t0 = time.perf_counter()
        draw_timeline(collect_report(run), Path(tmp) / "cost.png")
        seconds = time.perf_counter() - t0
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--iterations"] or ["2000", "10000"]
    for n in map(int, args):
        seconds, mib = measure(n)
        print(f"{n} iterations: {seconds:.2f} s, peak RSS {mib:.0f} MiB", flush=True)
