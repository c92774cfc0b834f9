"""What a shared log root holds is read as inert data: a regular file of bounded size.

What another user left in a run directory is read only as a regular file of bounded size in
that run, and never waited on: a FIFO, a device or a link out of the run is named and
skipped. What a run says (its logs, names, records) reaches the terminal inert: no escape
sequence acts, no rich markup or matplotlib math is interpreted. Run directories are built
by hand: no training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import BIN, cli_env

from mjlab_hpc.console import inert
from mjlab_hpc.rundir.ends import RankExit, RankStart, record_end, record_start
from mjlab_hpc.rundir.layout import RunDir

ESC = "\x1b"
CLEAR = f"{ESC}[2J"
TITLE = f"{ESC}]0;pwned{chr(7)}"
HOST = "[/oops]"


def _run(root: Path, name: str, state: str = "completed", **record: object) -> Path:
    """A run directory as a finished run leaves it (run.json, logs/), made by hand."""
    run = root / "cartpole" / name
    (run / "logs").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"state": state, "starts": [{}], **record}))
    return run


def _progress(path: Path, iterations: range) -> None:
    with open(path, "w") as f:
        for i in iterations:
            f.write(json.dumps({"iteration": i, "total": 100, "mean_reward": 1.5}) + "\n")


def _hpc(*args: object, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    proc = subprocess.run(
        [BIN / "mjlab-hpc", *map(str, args)],
        cwd=cwd,
        env=cli_env({"COLUMNS": "250"}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    # Well within the timeout: nothing waited on a file.
    assert time.monotonic() - started < 30, args
    return proc


def test_status_of_a_team_root_never_waits_or_follows_a_link_out(tmp_path: Path) -> None:
    """A FIFO progress.jsonl, a writer lock and a failed run's rank log that are FIFOs, links
    to /dev/zero and a link to another user's file: `status` of the whole root answers at
    once, each run named, what was not read said on its row."""
    root = tmp_path / "logs"
    fifo = _run(root, "2026-01-01_00-00-01_fifo")
    os.mkfifo(fifo / "progress.jsonl")
    zero = _run(root, "2026-01-01_00-00-02_zero")
    (zero / "progress.jsonl").symlink_to("/dev/zero")
    elsewhere = tmp_path / "secret.jsonl"  # a file of the reader's own, outside the run
    _progress(elsewhere, range(1, 1000))
    out = _run(root, "2026-01-01_00-00-03_out")
    (out / "progress.jsonl").symlink_to(elsewhere)
    locked = _run(root, "2026-01-01_00-00-04_lock", state="running")
    os.mkfifo(locked / ".writer.lock")
    failed = _run(root, "2026-01-01_00-00-05_failed", state="failed")
    os.mkfifo(failed / "logs" / "rank0.log")
    (failed / "logs" / "rank1.log").symlink_to("/dev/zero")
    words = _run(root, "2026-01-01_00-00-07_words", num_nodes="[/n]")  # text for numbers
    (words / "progress.jsonl").write_text(
        json.dumps({"iteration": "[/x]", "env_steps_per_s": "y", "mean_reward": "z"}) + "\n"
    )
    record = _run(root, "2026-01-01_00-00-06_record")
    (record / "run.json").unlink()
    (record / "run.json").symlink_to("/dev/zero")

    status = _hpc("status", "--log-root", root, cwd=tmp_path)
    text = " ".join(status.stdout.split())
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    for run in (fifo, zero, out, locked, failed, record, words):
        assert run.name in text, text
    assert "progress.jsonl is a FIFO, not a file: not read" in text, text
    assert "progress.jsonl is a character device, not a file: not read" in text, text
    assert "progress.jsonl is a link out of 2026-01-01_00-00-03_out: not read" in text, text
    assert "999/" not in text  # the file a link led to was not read

    listed = json.loads(_hpc("status", "--json", root, cwd=tmp_path).stdout)
    rows = {Path(r["run_dir"]).name: r for r in listed}
    assert rows[fifo.name]["unread"] == ["progress.jsonl is a FIFO, not a file"], rows
    assert rows[out.name]["iteration"] is None
    assert rows[locked.name]["state"] == "LOST" and rows[failed.name]["state"] == "FAILED"
    assert rows[record.name]["state"] == "DAMAGED"
    assert "run.json is damaged (is a character device, not a file)" in rows[record.name]["cause"]

    logs = _hpc("logs", failed, cwd=tmp_path)
    said = logs.stdout + logs.stderr
    assert "Traceback" not in said, said
    assert "(rank0.log is a FIFO, not a file: skipped)" in said, said
    assert "(rank1.log is a character device, not a file: skipped)" in said, said
    follow = _hpc("logs", failed, "--follow", "--lines", "0", cwd=tmp_path)
    assert "[rank 0] rank0.log is a FIFO, not a file: skipped" in follow.stdout, follow.stdout


def test_what_a_run_says_reaches_the_terminal_inert(tmp_path: Path) -> None:
    """A rank log with a screen clear, a window title and rich markup, on a host named
    `[/oops]`: `logs`, `logs --rank` and `logs --follow` print it, none of it acts."""
    run = _run(tmp_path / "logs", "2026-01-01_00-00-00_x", state="failed")
    start = f"2026-01-01 00:00:00,000 rank0 rank 0/1 (local 0) on cpu, host {HOST}, pid 1"
    (run / "logs" / "rank0.log").write_text(
        f"{start}\n"
        f"2026-01-01 00:00:01,000 rank0 {CLEAR}{TITLE}[bold red]fake[/] \x9b2J\u202eevil\n"
        "Traceback (most recent call last):\n"
        f'  File "x.py", line 1, in <module>\n'
        f"ValueError: {CLEAR}{HOST}\n"
        "2026-01-01 00:00:02,000 rank0 exit: failed (exception)\n"
        f"ValueError: {CLEAR}{HOST}\n"
    )
    # Decisions read the rank's records (rundir.ends): its start names the host.
    started = record_start(
        RunDir(run),
        RankStart(run=run.name, rank=0, world_size=1, node=HOST, pid=1, device="cpu", at=1.0),
    )
    failed = RankExit(how="failed", detail=f"ValueError: {CLEAR}{HOST}", at=2.0)
    record_end(RunDir(run), started, failed)
    for args in ([], ["--rank", "0"], ["--follow"]):
        proc = _hpc("logs", run, *args, cwd=tmp_path)
        said = proc.stdout + proc.stderr
        assert "Traceback (most recent call last)" in said and "MarkupError" not in said, said
        assert ESC not in said and "\x07" not in said and "\x9b" not in said, repr(said)
        assert "\\x1b[2J" in said and "\\x1b]0;pwned\\x07" in said, said
        assert "[bold red]fake[/]" in said and "\\u202eevil" in said, said
        assert f"rank 0 · {HOST}" in said or f"rank 0 on {HOST}" in said, said
    status = _hpc("status", run, cwd=tmp_path)
    assert ESC not in status.stdout and f"ValueError: \\x1b[2J{HOST}" in status.stdout


def test_a_run_named_with_a_dollar_is_plotted(tmp_path: Path) -> None:
    """`$` in a run's name is a dollar sign in the plot, not matplotlib's math (which
    crashed on `$_$`); a run whose event file is a FIFO is named and skipped."""
    run = _run(tmp_path / "logs", "2026-01-01_00-00-00_a$_$b")
    events = textwrap.dedent(
        """
        import sys
        from torch.utils.tensorboard import SummaryWriter
        w = SummaryWriter(sys.argv[1])
        for i in range(5):
            w.add_scalar("Train/mean_reward", float(i), i, walltime=1000.0 + i)
            w.add_scalar("Perf/total_fps", 100.0, i, walltime=1000.0 + i)
        w.close()
        """
    )
    subprocess.run([sys.executable, "-c", events, run], check=True, timeout=120)
    fifo = _run(tmp_path / "logs", "2026-01-01_00-00-00_fifo")
    os.mkfifo(fifo / "events.out.tfevents.1.host")  # tensorboard would wait on it forever
    png = tmp_path / "x.png"
    plot = _hpc("plot", run, fifo, "--out", png, cwd=tmp_path, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert "a$_$b: Train/mean_reward 5 points" in plot.stdout and png.stat().st_size > 0
    assert "fifo: events.out.tfevents.1.host is a FIFO, not a file: skipped" in plot.stdout


def test_inert() -> None:
    """Colours go, other controls show as escapes, newlines and tabs stay; markup on ask."""
    assert inert(f"a{ESC}[31mred{ESC}[0m\r\nb\tc") == "ared\nb\tc"
    assert inert(f"{CLEAR}{TITLE}\x00\x7f") == "\\x1b[2J\\x1b]0;pwned\\x07\\x00\\x7f"
    assert inert(f"{HOST} $x", markup=True) == "\\[/oops] $x"


_CUT = """
import re, sys
from pathlib import Path
from mjlab_hpc.rundir.layout import RunDir
from mjlab_hpc.rundir.writer import RunWriter
writer = RunWriter.acquire(RunDir(Path(sys.argv[1])), rank=0)
print(writer.cut_progress(int(sys.argv[2])))
writer.release()
print(re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1))
"""


def _cut(run: Path, iteration: int) -> tuple[str, int]:
    """What a resume's cut of progress.jsonl back to `iteration` says, and its peak memory
    (KiB: this process image's, not the parent's it was forked from), in a process of its
    own as a rank's start does it."""
    proc = subprocess.run(
        [sys.executable, "-c", _CUT, str(run), str(iteration)],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    said, peak = proc.stdout.split()
    return said, int(peak)


def test_a_resume_cuts_progress_back_without_holding_it(tmp_path: Path) -> None:
    """A resume cuts a 64 MB progress.jsonl back to its checkpoint streaming (the whole file
    in memory took 8-9 times its size); torn and foreign lines go. One that is a FIFO or a
    link out of the run is begun anew, its target untouched."""
    run = _run(tmp_path, "big")
    line = json.dumps({"iteration": 0, "total": 10**6, "mean_reward": 1.25, "pad": "x" * 200})
    count = (64 << 20) // len(line)
    with open(run / "progress.jsonl", "w") as f:
        for i in range(1, count + 1):
            f.write(line.replace('"iteration": 0', f'"iteration": {i}', 1) + "\n")
        f.write('["not ours"]\n{"iteration": "x"}\n{"iteration": 7')  # foreign, torn
    last, peak_kib = _cut(run, 1000)
    assert last == str(count)
    assert peak_kib < 64 << 10, peak_kib  # less than the file: the interpreter, about 27 MB
    kept = (run / "progress.jsonl").read_text().splitlines()
    assert [json.loads(k)["iteration"] for k in kept] == list(range(1, 1001))

    os.unlink(run / "progress.jsonl")
    os.mkfifo(run / "progress.jsonl")
    assert _cut(run, 5)[0] == "None" and (run / "progress.jsonl").read_bytes() == b""
    elsewhere = tmp_path / "mine.jsonl"
    _progress(elsewhere, range(1, 20))
    before = elsewhere.read_bytes()
    os.unlink(run / "progress.jsonl")
    (run / "progress.jsonl").symlink_to(elsewhere)
    assert _cut(run, 5)[0] == "None" and elsewhere.read_bytes() == before
    assert not (run / "progress.jsonl").is_symlink()


def test_a_sweep_elements_task_output_is_read_a_link_elsewhere_is_not(tmp_path: Path) -> None:
    """The one link we make (a sweep element's `submitit` to its sweep's folder) is followed;
    the same link to a folder elsewhere is not."""
    root = tmp_path / "logs"
    sweep = root / "cartpole" / ".sweeps" / "2026-01-01_00-00-00"
    (sweep / "submitit").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for folder, said in ((sweep / "submitit", "the sweep's"), (elsewhere, "not the run's")):
        (folder / "123_0_0_log.err").write_text(f"{said} task output\n")
    for name, target in (("element", sweep / "submitit"), ("hostile", elsewhere)):
        run = _run(root, f"2026-01-01_00-00-00_{name}")
        (run / "submitit").symlink_to(os.path.relpath(target, run))
        element = {"sweep_dir": str(sweep), "index": 0, "job_id": "123_0", "executor": "local"}
        (run / "sweep_element.json").write_text(json.dumps({**element, "overrides": {}}))
    shown = _hpc(
        "logs",
        root / "cartpole" / "2026-01-01_00-00-00_element",
        "--rank",
        "0",
        "--stream",
        "err",
        cwd=tmp_path,
    )
    assert "the sweep's task output" in shown.stdout, shown.stdout + shown.stderr
    hidden = _hpc(
        "logs", root / "cartpole" / "2026-01-01_00-00-00_hostile", "--rank", "0", cwd=tmp_path
    )
    assert hidden.returncode == 2 and "no files of rank 0" in hidden.stderr, hidden.stderr
