"""Tests of mjlab_hpc.hostlist against Slurm's hostlist syntax."""

from __future__ import annotations

import os
import pickle
import random
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster

from mjlab_hpc.slurm.hostlist import (
    MAX_HOSTS,
    SLURM_MAX_RANGE,
    HostlistError,
    expand_hostlist,
    first_host,
)

# (expression, expected `scontrol show hostnames` lines)
VALID: list[tuple[str, list[str]]] = [
    # plain names and comma-separated groups
    ("node1", ["node1"]),
    ("a,b,c", ["a", "b", "c"]),
    ("login-1.example.org", ["login-1.example.org"]),
    ("node007", ["node007"]),
    ("n1,n1", ["n1", "n1"]),
    # bracket ranges and lists
    ("node[1-2]", ["node1", "node2"]),
    ("node[1]", ["node1"]),
    ("GPU[1-2]", ["GPU1", "GPU2"]),
    ("gpu[001-004,010]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]),
    ("n[3,1,2]", ["n3", "n1", "n2"]),
    ("n[1-2,2,1]", ["n1", "n2", "n2", "n1"]),
    ("n[1-3],n[2-4]", ["n1", "n2", "n3", "n2", "n3", "n4"]),
    ("cn[7-9,10-11]", ["cn7", "cn8", "cn9", "cn10", "cn11"]),
    ("[1-3]", ["1", "2", "3"]),
    # zero padding: the width is the number of digits of the range's start
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[09-10]", ["n09", "n10"]),
    ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
    ("n[001-3]", ["n001", "n002", "n003"]),
    ("n[0-2]", ["n0", "n1", "n2"]),
    ("n[00]", ["n00"]),
    ("n[0001-0002,3]", ["n0001", "n0002", "n3"]),
    # text after a bracket, dashes and dots
    ("rack[1-2]node", ["rack1node", "rack2node"]),
    ("node[1-2]-ib0", ["node1-ib0", "node2-ib0"]),
    ("gpu-a100-[01-02].cluster", ["gpu-a100-01.cluster", "gpu-a100-02.cluster"]),
    ("[01-02]x", ["01x", "02x"]),
    ("-[1-2]", ["-1", "-2"]),
    ("--ib0,n1", ["--ib0", "n1"]),
    # commas inside brackets do not split groups
    ("x[1,3],y[2-3]", ["x1", "x3", "y2", "y3"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("n01,n[02-03],n04", ["n01", "n02", "n03", "n04"]),
    # several brackets in one name: a cartesian product in Slurm's order
    ("a[1-2]-ib[3-4]", ["a1-ib3", "a1-ib4", "a2-ib3", "a2-ib4"]),
    ("a[1]-b[2]", ["a1-b2"]),
    ("a[1-2][3-4]", ["a13", "a14", "a23", "a24"]),
    ("r[1-2]n[1-2]s", ["r1n1s", "r1n2s", "r2n1s", "r2n2s"]),
    (
        "rack[1-2]-node[01-02],login1",
        ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02", "login1"],
    ),
    # with three or more brackets the last varies fastest, then the first, ...
    (
        "a[1-2]b[3-4]c[5-6]",
        ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"],
    ),
    (
        "a[1-2]b[3]c[4-5]d[6-7]",
        [
            *("a1b3c4d6", "a1b3c4d7", "a2b3c4d6", "a2b3c4d7"),
            *("a1b3c5d6", "a1b3c5d7", "a2b3c5d6", "a2b3c5d7"),
        ],
    ),
    # whitespace separates like a comma; empty groups are skipped
    (" a , b ", ["a", "b"]),
    ("a b\tc\nd", ["a", "b", "c", "d"]),
    ("a,,b", ["a", "b"]),
    (",x[1-2],", ["x1", "x2"]),
    ("n[0-65535]", [f"n{i}" for i in range(65536)]),
]

# (expression, words the message must contain, what Slurm itself does with it:
#  "rejects" -- scontrol prints no host; "mangles" -- Slurm accepts it and prints
#  odd names, we refuse; "n/a" -- not comparable here)
INVALID: list[tuple[str, str, str]] = [
    ("", "empty expression", "rejects"),
    ("   ", "empty expression", "rejects"),
    (",, ,", "empty expression", "rejects"),
    ("a[5-3]", "descending range '5-3'", "rejects"),
    ("gpu[010-001]", "descending range", "rejects"),
    ("a[1", "unbalanced '['", "rejects"),
    ("x[1,3,y[2-3]", "nested '['", "mangles"),
    ("a[]", "empty brackets", "rejects"),
    ("a[1,,2]", "empty range", "rejects"),
    ("a[1,]", "empty range", "rejects"),
    ("a[,1]", "empty range", "rejects"),
    ("a[x]", "non-numeric range 'x'", "rejects"),
    ("a[1-b]", "non-numeric range '1-b'", "rejects"),
    ("a[a-3]", "non-numeric range 'a-3'", "rejects"),
    ("a[1-2-3]", "non-numeric range '1-2-3'", "rejects"),
    ("a[-3]", "has no start", "rejects"),
    ("a[1--3]", "non-numeric range '1--3'", "rejects"),
    ("n[1-9:2]", "stepped range", "rejects"),
    ("n[1-3]x[1", "unbalanced '['", "rejects"),
    ("n[0-65536]", "at most 65536 per range", "rejects"),
    ("a[0-40000,40001-70000]b[1]", "at most 65536 in any bracket", "rejects"),
    ("a[1-1000]b[1-1001]", f"more than {MAX_HOSTS} hosts", "n/a"),
    ("feature{gpu}", "hostlist functions", "n/a"),
    ("a]", "unbalanced ']'", "mangles"),
    ("a[1]b]", "unbalanced ']'", "mangles"),
    ("a[[1]]", "nested '['", "mangles"),
    ("a[1-]", "has no end", "mangles"),
    ("a[ 1]", "non-numeric range ' 1'", "mangles"),
    ("a[1, 2]", "non-numeric range ' 2'", "mangles"),
    ("a[+1]", "non-numeric range '+1'", "mangles"),
    ("a[1a-3]", "non-numeric range '1a-3'", "mangles"),
]


def _ids(cases: list[tuple[str, ...]] | list[tuple[str, list[str]]]) -> list[str]:
    return [repr(case[0]) for case in cases]


@pytest.mark.parametrize(("expr", "expected"), VALID, ids=_ids(VALID))
def test_expand_valid(expr: str, expected: list[str]) -> None:
    assert expand_hostlist(expr) == expected


@pytest.mark.parametrize(("expr", "words", "slurm"), INVALID, ids=_ids(INVALID))
def test_expand_invalid(expr: str, words: str, slurm: str) -> None:
    with pytest.raises(HostlistError) as info:
        expand_hostlist(expr)
    message = str(info.value)
    assert repr(expr) in message
    assert words in message
    assert info.value.expr == expr


def test_error_is_value_error_and_picklable() -> None:
    with pytest.raises(ValueError, match="descending"):
        expand_hostlist("a[5-3]")
    err = HostlistError("a[5-3]", "descending range")
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.expr, copy.reason, str(copy)) == (err.expr, err.reason, str(err))


def test_error_message_shortens_huge_expression() -> None:
    expr = "n" * 10_000 + "["
    with pytest.raises(HostlistError) as info:
        expand_hostlist(expr)
    assert len(str(info.value)) < 500
    assert "10001 characters" in str(info.value)


def test_non_string_is_type_error() -> None:
    with pytest.raises(TypeError):
        expand_hostlist(None)  # type: ignore[arg-type]


def test_max_hosts_cap() -> None:
    assert len(expand_hostlist("n[1-10]", max_hosts=10)) == 10
    with pytest.raises(HostlistError, match="more than 9 hosts"):
        expand_hostlist("n[1-10]", max_hosts=9)
    # summed over groups, and refused before anything is expanded
    with pytest.raises(HostlistError, match="more than 15 hosts"):
        expand_hostlist("a[1-10],b[1-10]", max_hosts=15)
    start = time.perf_counter()
    with pytest.raises(HostlistError):
        expand_hostlist("a[0-65535]b[0-65535]c[0-65535]")
    assert time.perf_counter() - start < 1.0


def test_slurm_range_limits() -> None:
    assert len(expand_hostlist(f"n[1-{SLURM_MAX_RANGE}]")) == SLURM_MAX_RANGE
    # the last bracket may hold more than one range's worth, in several ranges
    assert len(expand_hostlist("n[0-60000,60001-70000]")) == 70001
    assert len(expand_hostlist("a[1-1000]b[1-1000]")) == MAX_HOSTS


# ---- first_host ---------------------------------------------------------------------------


def _fake_scontrol(tmp_path: Path, script: str) -> Path:
    """Write an executable `scontrol` shell script; return its directory."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / "scontrol"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(0o755)
    return bindir


def _prepend_path(monkeypatch: pytest.MonkeyPatch, bindir: Path) -> None:
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.parametrize(("expr", "expected"), VALID, ids=_ids(VALID))
def test_first_host_parser(expr: str, expected: list[str]) -> None:
    assert first_host(expr, scontrol=None) == expected[0]


def test_first_host_scontrol_none_ignores_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _prepend_path(monkeypatch, _fake_scontrol(tmp_path, "echo wrong\n"))
    assert first_host("gpu[001-004]", scontrol=None) == "gpu001"


def test_first_host_uses_scontrol_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = _fake_scontrol(
        tmp_path, 'printf "%s\\n" "$@" > "$0.args"\necho chosen-by-scontrol\necho second\n'
    )
    _prepend_path(monkeypatch, bindir)
    assert first_host("gpu[001-004]") == "chosen-by-scontrol"
    args = (bindir / "scontrol.args").read_text().splitlines()
    assert args == ["show", "hostnames", "gpu[001-004]"]


def test_first_host_scontrol_leading_dash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = _fake_scontrol(tmp_path, 'printf "%s\\n" "$@" > "$0.args"\necho from-scontrol\n')
    _prepend_path(monkeypatch, bindir)
    assert first_host("-[1-2]") == "from-scontrol"
    args = (bindir / "scontrol.args").read_text().splitlines()
    # "--" keeps scontrol's getopt from reading the expression as options
    assert args == ["show", "hostnames", "--", "-[1-2]"]


def test_first_host_scontrol_as_path_and_env_passed(tmp_path: Path) -> None:
    bindir = _fake_scontrol(tmp_path, 'echo "$FAKE_FIRST_HOST"\n')
    env = {"PATH": str(bindir), "FAKE_FIRST_HOST": "from-env7"}
    # looked up on env["PATH"], and the environment reaches the child
    assert first_host("n[1-2]", env=env) == "from-env7"
    assert first_host("n[1-2]", scontrol=str(bindir / "scontrol"), env=env) == "from-env7"


def test_first_host_scontrol_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _prepend_path(monkeypatch, _fake_scontrol(tmp_path, "echo oops\necho boom >&2\nexit 3\n"))
    assert first_host("gpu[003-004],a") == "gpu003"
    with pytest.raises(HostlistError, match="descending"):
        first_host("a[5-3]")


def test_first_host_scontrol_prints_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Real scontrol prints "Invalid hostlist" on stderr and still exits 0.
    _prepend_path(monkeypatch, _fake_scontrol(tmp_path, "echo 'Invalid hostlist' >&2\n"))
    assert first_host("n[08-11]") == "n08"


def test_first_host_scontrol_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `sleep` is a child of the shell and holds the stdout pipe: the whole
    # process group must be killed for the fallback to be quick.
    _prepend_path(monkeypatch, _fake_scontrol(tmp_path, "sleep 30\necho late\n"))
    start = time.perf_counter()
    assert first_host("x[1,3],y[2-3]", timeout_s=0.5) == "x1"
    assert time.perf_counter() - start < 10


def test_first_host_scontrol_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert first_host("rack[1-2]node") == "rack1node"
    assert first_host("rack[1-2]node", scontrol="no-such-scontrol-here") == "rack1node"
    assert first_host("rack[1-2]node", scontrol=str(tmp_path / "absent")) == "rack1node"


def test_first_host_scontrol_not_executable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = _fake_scontrol(tmp_path, "echo wrong\n")
    (bindir / "scontrol").chmod(0o644)
    _prepend_path(monkeypatch, bindir)
    assert first_host("a[1-2]-ib[3-4]") == "a1-ib3"


def test_first_host_empty_expression_raises() -> None:
    with pytest.raises(HostlistError, match="empty expression"):
        first_host(" , ")


# ---- agreement with a real Slurm ---------------------------------------------------------

# These use the project's real Slurm test cluster (its scontrol and SLURM_CONF): they run
# wherever the cluster can start, and fail under CI=true when it cannot.


def _scontrol_hostnames(cluster: SlurmCluster, expr: str) -> list[str]:
    proc = cluster.run(["scontrol", "show", "hostnames", "--", expr], check=False, timeout=60)
    return proc.stdout.splitlines() if proc.returncode == 0 else []


# Slurm 22.05 (Debian 12's) rejects a suffix after the last bracket (`node[1-2]-ib0`), which
# 23.11 and later accept and the parser follows. The invariant that holds for every version:
# whenever the installed Slurm expands an expression, the parser gives the same hosts; from
# 23.11 on (the 24.11 test cluster) Slurm expands every one of them, suffixes included.


def _all_expand(cluster: SlurmCluster) -> bool:
    return cluster.version >= "23.11"


@pytest.mark.slurm
def test_parser_agrees_with_scontrol(slurm_cluster: SlurmCluster) -> None:
    compared = 0
    for expr, expected in VALID:
        slurm = _scontrol_hostnames(slurm_cluster, expr)
        if slurm:
            assert slurm == expected, expr
            assert first_host(expr, env=slurm_cluster.environ()) == expected[0], expr
            compared += 1
    least = len(VALID) if _all_expand(slurm_cluster) else 35
    assert compared >= least, f"only {compared} of {len(VALID)} cases compared"


def _random_expressions(count: int, seed: int = 2024) -> list[str]:
    """Valid expressions built from names, brackets and suffixes at random."""
    rng = random.Random(seed)

    def bound() -> str:
        return str(rng.randint(0, 12)).zfill(rng.choice([1, 1, 2, 3]))

    def bracket() -> str:
        items = []
        for _ in range(rng.randint(1, 3)):
            lo = bound()
            hi = str(int(lo) + rng.randint(0, 4)).zfill(rng.choice([1, 2]))
            items.append(lo if rng.random() < 0.5 else f"{lo}-{hi}")
        return "[" + ",".join(items) + "]"

    def name() -> str:
        parts = []
        for _ in range(rng.randint(1, 4)):
            parts.append(rng.choice(["", "n", "ab-", "x.", "r1", "7", "-"]))
            if rng.random() < 0.7:
                parts.append(bracket())
        parts.append(rng.choice(["", "", "s", ".c", "9", "-ib0"]))
        return "".join(parts) or "h"

    seps = [",", " ", ", ", "\t"]
    return [rng.choice(seps).join(name() for _ in range(rng.randint(1, 3))) for _ in range(count)]


@pytest.mark.slurm
def test_parser_agrees_with_scontrol_random(slurm_cluster: SlurmCluster) -> None:
    compared = 0
    for expr in _random_expressions(300):
        slurm = _scontrol_hostnames(slurm_cluster, expr)
        if slurm:
            assert expand_hostlist(expr) == slurm, expr
            compared += 1
    least = 300 if _all_expand(slurm_cluster) else 30
    assert compared >= least, f"only {compared} of 300 random expressions compared"


# ---- 10,000-node lists ------------------------------------------------------------------


def _fragmented(hosts: int) -> str:
    """Every other node of `2 * hosts`: one bracket of `hosts` items, as Slurm compresses a
    scattered allocation."""
    return "n[" + ",".join(str(i) for i in range(1, 2 * hosts, 2)) + "]"


# Forms Slurm emits for 10,000 nodes (several prefixes, padding, two brackets, a scattered
# allocation, pairs, no compression at all).
HUGE = {
    "one range": "node[00001-10000]",
    "prefixes": "gpu[0001-2500],cpu[0001-2500],mem[01-5000]",
    "two brackets": "rack[01-40]-node[001-250]",
    "scattered": _fragmented(10_000),
    "pairs": "n[" + ",".join(f"{i:05d}-{i + 1:05d}" for i in range(0, 20_000, 4)) + "]",
    "plain": ",".join(f"n{i:05d}" for i in range(10_000)),
}


def _best_of_3(expr: str) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        expand_hostlist(expr)
        times.append(time.perf_counter() - t0)
    return min(times)


def test_10000_node_lists_are_fast_and_linear(capsys: pytest.CaptureFixture) -> None:
    """Each 10,000-node form expands in well under a second (about 5-100 ms here), and 8x the
    items of one bracket costs about 8x (quoting the group per item once made it quadratic:
    1 s for 10,000 items, 13 s for 40,000, 100 s for 100,000)."""
    times = {}
    for name, expr in HUGE.items():
        assert len(expand_hostlist(expr)) == 10_000, name
        times[name] = _best_of_3(expr)
        assert times[name] < 0.5, (name, times[name])
    ratio = _best_of_3(_fragmented(80_000)) / times["scattered"]
    assert ratio < 20, f"80,000 items cost {ratio:.1f}x 10,000 (linear: 8x, quadratic: 64x)"
    with capsys.disabled():
        shown = ", ".join(f"{k} {1000 * v:.0f} ms" for k, v in times.items())
        print(f"\n[hostlist 10,000 nodes] {shown}; 8x items: {ratio:.1f}x time")


@pytest.mark.slurm
def test_10000_node_lists_agree_with_scontrol(slurm_cluster: SlurmCluster) -> None:
    for name, expr in HUGE.items():
        assert expand_hostlist(expr) == _scontrol_hostnames(slurm_cluster, expr), name
