"""`make bench-recovery` / `python -m benchmarks.recovery`: self-healing on Slurm, measured.

Each case is one 2-node cartpole job (a rank per node, CPU) on the Slurm cluster this shell
talks to (`SLURM_CONF`; `make bench-recovery` brings up a test cluster of 3 nodes). The faults
are a crash (rank 1 kills itself, SIGKILL), a hang (rank 1 stops itself, SIGSTOP,
`--hang-timeout-s 5`) and a hard node loss (rank 1's node: its slurmd and all under it killed
at once, as in a power cut; `cluster.sh lose`, so only on our test cluster). Each runs with a
spare node (`--spare-nodes 1`) and with `--min-nodes 1` (no spare); the node loss also with
neither, a requeue that waits for Slurm to call the node dead (`SlurmdTimeout`).

Per case, run.json's fault gives the seconds from the fault to the first resumed iteration,
the iterations recomputed and the world size after; Slurm gives its requeues (Restarts=,
expected 0 but 1 without a spare). The final parameters must equal those of an uninterrupted
2-rank run (`mjlab-train --num-procs 2`) where the world size is kept.

Prints a table and writes `<out>/recovery.json`. Exit code 1 when a case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.stats import read_jsonl
from benchmarks.watch import bench_env, cli, find_run_dir, kill_job
from mjlab_hpc.rundir.ends import start_hosts
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.record import read_record
from mjlab_hpc.slurm.client import FINAL_STATES, SlurmClient

__all__ = ["CASES", "Case", "main", "outcome", "print_table", "run_case"]

CLUSTER_SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "cluster" / "cluster.sh"
TRAIN = [
    "cartpole",
    "--num-envs",
    "64",
    "--seed",
    "11",
    "--torch-threads",
    "1",
    "--save-interval",
    "5",
    "--max-iterations",
    "12",
]
JOB = ["--nodes", "2", "--tasks-per-node", "1", "--gpus-per-node", "0", "--time", "10"]
HANG_TIMEOUT_S = 5
FAULT_AT = 8
LOSE_AT = 6
RUN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Case:
    """One fault, with a spare or with fewer nodes."""

    name: str
    """crash-spare, hang-min-nodes, ..."""
    fault: str
    """MJLAB_HPC_FAULT of the job."""
    args: tuple[str, ...]
    """mjlab-submit's flags beyond the job's."""
    lose_node: bool = False
    """Lose rank 1's node once it has stopped itself (the fault only holds it there)."""
    requeues: int = 0
    """Slurm's requeues the heal should take (0: a restart in the allocation)."""


def _cases() -> tuple[Case, ...]:
    spare, fewer = ("--spare-nodes", "1"), ("--min-nodes", "1")
    hang = ("--hang-timeout-s", str(HANG_TIMEOUT_S))
    out = []
    for how, extra in (("spare", spare), ("min-nodes", fewer)):
        out += [
            Case(f"crash-{how}", f"kill@{FAULT_AT}:rank1:once", extra),
            Case(f"hang-{how}", f"stop@{FAULT_AT}:rank1:once", (*extra, *hang)),
            Case(f"node-loss-{how}", f"stop@{LOSE_AT}:rank1:once", extra, lose_node=True),
        ]
    # Neither: a requeue without the node, which runs once Slurm calls the node dead.
    no_spare = Case(
        "node-loss-no-spare", f"stop@{LOSE_AT}:rank1:once", (), lose_node=True, requeues=1
    )
    return (*out, no_spare)


CASES = _cases()


def _cluster(command: str, node: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), command, node],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _wait(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _job_ended(client: SlurmClient, job: str) -> bool:
    state = client.job_state(job)
    return state is None or state in FINAL_STATES


def _restarts(client: SlurmClient, job: str) -> int | None:
    text = client.show_job(job) or ""
    return int(text.split("Restarts=")[1].split()[0]) if "Restarts=" in text else None


def run_case(case: Case, root: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run one case: submit its job, lose the node where it asks to, wait for the end.

    It waits for the run to end and for its job to leave the queue, and returns what
    `outcome` reads (RuntimeError when it did not end). The job is cancelled and the node
    brought back whatever happens.
    """
    client = SlurmClient(env=env)
    cmd = [cli("mjlab-submit"), *TRAIN, *JOB, *case.args, "--log-root", str(root)]
    proc = subprocess.run(
        cmd,
        env={**env, "MJLAB_HPC_FAULT": case.fault},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"mjlab-submit exited {proc.returncode}: {proc.stderr[-1500:]}")
    path = _wait(lambda: find_run_dir(root), 60, "the run directory")
    run, lost, job = RunDir(path), None, None
    try:
        job = str(_wait(lambda: (read_record(path).job_ids or (None,))[0], 120, "the job to start"))
        if case.lose_node:
            _wait(
                lambda: (read_jsonl(run.progress) or [{}])[-1].get("iteration", 0) >= LOSE_AT,
                240,
                f"iteration {LOSE_AT}",
            )
            (lost,) = start_hosts(path, 1)
            killed = _cluster("lose", lost)
            if killed.returncode != 0:
                lost = None
                raise RuntimeError(f"cluster.sh lose: {killed.stderr.strip()}")
        summary = _wait(
            lambda: run.summary.exists() and json.loads(run.summary.read_text()),
            RUN_TIMEOUT_S,
            "the run to finish",
        )
        if lost is not None:
            _cluster("node-up", lost)
            lost = None
        _wait(lambda: _job_ended(client, job), 120, f"job {job} to leave the queue")
    finally:
        if lost is not None:
            _cluster("node-up", lost)
        if job is not None and not _job_ended(client, job):
            client.scancel([job])
    faults = read_record(path).faults
    return {"summary": summary, "faults": faults, "restarts": _restarts(client, job)}


def outcome(case: Case, got: dict[str, Any], reference: Sequence[str] | None) -> dict[str, Any]:
    """Compute the case's figures from what `run_case` returned.

    ValueError when the run did not heal as the case expects: one fault, healed in the
    allocation or by a requeue, to the last iteration.
    """
    summary, faults = got["summary"], got["faults"]
    kind = "requeue" if case.requeues else "in-allocation"
    if len(faults) != 1 or faults[0].kind != kind:
        raise ValueError(f"expected one fault healed by kind {kind}, got {faults}")
    fault = faults[0]
    if summary.get("iterations") != int(TRAIN[TRAIN.index("--max-iterations") + 1]):
        raise ValueError(f"the run ended at iteration {summary.get('iterations')}")
    world = fault.world_size or (summary["world_size"], summary["world_size"])
    digests = summary.get("param_digest_per_rank")
    if world[0] != world[1]:
        same = None  # fewer ranks: not the same training by design
    else:
        same = reference is not None and list(digests or []) == list(reference)
    return {
        "case": case.name,
        "reason": fault.reason,
        "recovery_s": fault.recovery_s,
        "recomputed": fault.recomputed,
        "resumed_from": fault.resumed_from,
        "world_size": list(world),
        "excluded_nodes": list(fault.excluded_nodes),
        "requeues": got["restarts"],
        "as_expected": got["restarts"] == case.requeues and fault.job_id == str(summary["job_id"]),
        "bit_identical": same,
    }


def _fmt(value: Any, spec: str) -> str:
    return format("-", f">{spec.split('.')[0]}") if value is None else format(value, spec)


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """One line per case."""
    print(
        f"{'case':<22} {'fault->resumed s':>16} {'recomputed':>10} {'ranks':>6} "
        f"{'requeues':>8}  bit-identical"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<22} failed: {r['error']}")
            continue
        ident = {True: "yes", False: "NO", None: "n/a (fewer ranks)"}[r["bit_identical"]]
        ranks = f"{r['world_size'][0]}->{r['world_size'][1]}"
        print(
            f"{r['case']:<22} {_fmt(r['recovery_s'], '16.1f')} {_fmt(r['recomputed'], '10')} "
            f"{ranks:>6} {_fmt(r['requeues'], '8')}{'' if r['as_expected'] else '!'}  "
            f"{ident}"
        )


def _reference(root: Path, env: dict[str, str]) -> list[str]:
    """Per-rank digests of the uninterrupted run (2 local ranks: the same training)."""
    cmd = [cli("mjlab-train"), *TRAIN, "--num-procs", "2", "--log-root", str(root)]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        kill_job(proc)  # its ranks too, whatever happened
    path = find_run_dir(root)
    if proc.returncode != 0 or path is None:
        raise RuntimeError(f"the reference run exited {proc.returncode}: {err[-1500:]}")
    return list(json.loads(RunDir(path).summary.read_text())["param_digest_per_rank"])


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.recovery",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="bench-results", help="folder of recovery.json")
    p.add_argument(
        "--cases",
        default=",".join(c.name for c in CASES),
        help="comma-separated cases (default: all)",
    )
    p.add_argument("--work", default=None, help="folder of the runs (default: <out>/recovery)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cases; 0 when every case healed as it should.

    A case heals in its allocation, or by one requeue without a spare, to the parameters of
    the uninterrupted run where the world size was kept.
    """
    args = _parse(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown or not names:
        print(
            f"--cases: unknown {', '.join(unknown) or '(none given)'}; known: "
            f"{', '.join(c.name for c in CASES)}",
            file=sys.stderr,
        )
        return 2
    probe = SlurmClient().run(["sinfo", "-h", "-o", "%D"])
    nodes = sum(int(n) for n in probe.stdout.split()) if probe and probe.returncode == 0 else 0
    if nodes < 3:
        print(
            f"self-healing on Slurm needs a cluster of 3 nodes here ({nodes} answer): run "
            "`make bench-recovery`, which starts a test cluster",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "recovery"
    work.mkdir(parents=True, exist_ok=True)
    # SLURM_CONF is kept: bench_env drops an enclosing job's SLURM_* variables.
    env = bench_env({k: v for k, v in os.environ.items() if k == "SLURM_CONF"})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print("[recovery] the uninterrupted run (2 local ranks) ...", flush=True)
    reference = _reference(work / f"{stamp}-reference", env)
    rows: list[dict[str, Any]] = []
    for case in (c for c in CASES if c.name in names):
        print(
            f"[recovery] {case.name} ({case.fault}{', node lost' * case.lose_node}) ...", flush=True
        )
        try:
            rows.append(
                outcome(case, run_case(case, work / f"{stamp}-{case.name}", env), reference)
            )
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            rows.append({"case": case.name, "error": str(exc)[-800:]})
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps({"at": stamp, "cases": rows}, indent=1))
    print_table(rows)
    print(f"[recovery] {out / 'recovery.json'}")
    bad = [r for r in rows if "error" in r or not r["as_expected"] or r["bit_identical"] is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
