"""A forged or damaged file of one run in a team's log root takes down no command.

Each run below is a copy of a real failed run (main's records, `tests/rundir/data`) with one
hostile file or line: a time of 1e20, NaN, Infinity, -1 or "x", a 10 MB line, a FIFO, a link
out of the run, a run.json of a newer schema. `status` (the whole log root, as a user runs
it), `logs`, `report`, `cancel`, the healer and `--resume` each go on, name the bad file
and leave it out (found: one forged rank record took down `status` and `logs` for the whole
log root, OverflowError; NaN: ValueError; a checkpoint line `"at": 4e9` made 612,240
node-hours).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import BIN, cli_env

from mjlab_hpc.launch.heal import decide
from mjlab_hpc.ops.cancel import cancel_local
from mjlab_hpc.ops.logs import find_tracebacks, rank_files
from mjlab_hpc.ops.report import collect_report
from mjlab_hpc.ops.status import collect
from mjlab_hpc.slurm.client import SlurmClient

HEALED = Path(__file__).parents[1] / "rundir/data/main-d42f375/logs/cartpole/2026-11-29_07-54-15"
END = "logs/ranks/rank1.2.end.json"
START = "logs/ranks/rank0.2.start.json"
CHECKPOINTS = "logs/checkpoints.jsonl"


def _end(at: str) -> Callable[[Path], None]:
    def forge(run: Path) -> None:
        (run / END).write_text(f'{{"how": "failed", "detail": "forged", "at": {at}}}')

    return forge


def _json(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def forge(run: Path) -> None:
        value = json.loads((run / name).read_text())
        change(value)
        (run / name).write_text(json.dumps(value))

    return forge


def _checkpoint_line(line: str) -> Callable[[Path], None]:
    def forge(run: Path) -> None:
        with (run / CHECKPOINTS).open("a") as f:
            f.write(line + "\n")

    return forge


def _fifo(name: str) -> Callable[[Path], None]:
    def forge(run: Path) -> None:
        (run / name).unlink(missing_ok=True)
        os.mkfifo(run / name)

    return forge


def _link_out(name: str) -> Callable[[Path], None]:
    def forge(run: Path) -> None:
        outside = run.parent.parent.parent / f"outside-{run.name}.json"
        outside.write_text((run / name).read_text() if (run / name).exists() else "{}")
        (run / name).unlink(missing_ok=True)
        (run / name).symlink_to(outside)

    return forge


def _long_progress_line(run: Path) -> None:
    lines = (run / "progress.jsonl").read_text().splitlines(keepends=True)
    pad = "x" * (10 << 20)
    (run / "progress.jsonl").write_text(f'{lines[0]}{{"iteration": 1, "p": "{pad}"}}\n{lines[1]}')


def _oom(value: dict) -> None:
    value["oom"]["counter"] = "/dev/zero"  # read again by a reader under the same kernel


# (the run's name, what is forged, the file a reader must name; None: a value left out
# silently is none of the run's own, or the reader that sees it says it elsewhere)
CASES: list[tuple[str, Callable[[Path], None], str | None]] = [
    ("end-1e20", _end("1e20"), END),
    ("end-nan", _end("NaN"), END),
    ("end-infinity", _end("Infinity"), END),
    ("end-minus-1", _end("-1"), END),
    ("end-text", _end('"x"'), END),
    ("end-fifo", _fifo(END), END),
    ("end-link-out", _link_out(END), END),
    ("start-rank-minus-1", _json(START, lambda v: v.update(rank=-1)), START),
    ("start-oom-dev-zero", _json(START, _oom), None),
    (
        "checkpoint-iteration-x",
        _checkpoint_line('{"iteration": "x", "at": 1795938947, "s": 1}'),
        CHECKPOINTS,
    ),
    ("checkpoint-at-4e9", _checkpoint_line('{"iteration": 3, "at": 4e9, "s": 1}'), CHECKPOINTS),
    ("progress-10mb-line", _long_progress_line, "progress.jsonl"),
    (
        "progress-nan",
        lambda r: (r / "progress.jsonl").open("a").write('{"iteration": 3, "mean_reward": NaN}\n'),
        "progress.jsonl",
    ),
    ("fault-at-1e20", _json("run.json", lambda v: v["faults"][0].update(at_s=1e20)), "run.json"),
    ("newer-schema", _json("run.json", lambda v: v.update(schema=99)), "run.json"),
    ("cancel-fifo", _fifo("cancelled.json"), None),
    ("element-link-out", _link_out("sweep_element.json"), "sweep_element.json"),
]


@pytest.fixture(scope="module")
def log_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("team") / "logs"
    for name, forge, _ in CASES:
        run = root / "cartpole" / f"2026-11-29_07-54-15_{name}"
        shutil.copytree(HEALED, run)
        _json("run.json", lambda v: v.update(state="failed"))(run)  # status asks who failed
        forge(run)
    return root


def _run(root: Path, name: str) -> Path:
    return root / "cartpole" / f"2026-11-29_07-54-15_{name}"


def _named(said: str, file: str) -> bool:
    return Path(file).name in said


def test_status_of_the_whole_log_root_names_each_bad_file(log_root: Path) -> None:
    proc = subprocess.run(
        [str(BIN / "mjlab-hpc"), "status", "--json", "--log-root", str(log_root)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=180,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = {
        Path(r["run_dir"]).name.removeprefix("2026-11-29_07-54-15_"): r
        for r in json.loads(proc.stdout)
    }
    assert set(rows) == {name for name, _, _ in CASES}
    for name, _, file in CASES:
        row = rows[name]
        said = " ".join([*row["unread"], row["cause"] or ""])
        if file is not None and file != CHECKPOINTS and name != "progress-10mb-line":
            assert _named(said, file), (name, said)  # (status reads neither of those)
        if file == END:  # the forged end is left out: the start ended without a word
            assert "rank 1 on vm ended without an exit record" in said, (name, said)
    assert rows["newer-schema"]["state"] == "DAMAGED"
    assert "written by a newer mjlab-hpc" in rows["newer-schema"]["cause"]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_logs_report_cancel_and_the_healer_go_on_and_name_the_file(
    log_root: Path, name: str
) -> None:
    run = _run(log_root, name)
    file = next(f for n, _, f in CASES if n == name)
    unread: list[str] = []
    ranks = rank_files(run, unread)
    assert [f.rank for f in ranks] == [0, 1] and find_tracebacks(ranks)
    row = collect([run], SlurmClient()).rows[0]
    cost = collect_report(run)
    assert 0 < cost.node_hours < 1, cost.node_hours  # not 612,240
    said = " ".join([*unread, *row.unread, *cost.notes, row.cause or ""])
    if file is not None:
        assert _named(said, file), (name, said)
    heal = decide(run, max_restarts=3)
    if file == END:  # left out: rank 1 ended without a word, as far as anyone can tell
        assert heal.fault is not None and heal.fault.ranks == (1,), heal
    assert cancel_local(run).ok


def test_logs_report_and_a_continuation_as_users_run_them(log_root: Path) -> None:
    resume = ["cartpole", "--executor", "local", "--gpus-per-node", "0", "--dry-run", "--run-dir"]
    for command, name, words in (
        ("logs", "end-1e20", "rank1.2.end.json is damaged (its 'at' is 1e+20"),
        ("logs", "end-nan", "rank1.2.end.json is damaged (it is not JSON)"),
        ("report", "checkpoint-at-4e9", "checkpoints.jsonl line 3 is damaged (its 'at' is 4"),
        ("report", "checkpoint-iteration-x", "its 'iteration' is \"x\", not an integer"),
        ("submit", "fault-at-1e20", "run.json is damaged (its 'faults[0].at_s' is 1e+20"),
    ):
        argv = [str(BIN / "mjlab-hpc"), command, str(_run(log_root, name))]
        if command == "submit":  # a continuation of it: the record is set aside, not trusted
            argv = [str(BIN / "mjlab-submit"), *resume, str(_run(log_root, name))]
        proc = subprocess.run(argv, capture_output=True, text=True, env=cli_env(), timeout=180)
        out = " ".join((proc.stdout + proc.stderr).split())  # (logs shows the ranks' own)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (command, name, out)
        assert words in out, (command, name, out[-3000:])


def test_a_newer_run_record_is_never_healed_into_ours(log_root: Path) -> None:
    run = _run(log_root, "newer-schema")
    before = (run / "run.json").read_text()
    heal = decide(run, max_restarts=3)
    assert heal.fault is None and "written by a newer mjlab-hpc" in heal.why
    assert (run / "run.json").read_text() == before
