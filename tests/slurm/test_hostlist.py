"""The rendezvous host: the first host of a Slurm node list, read without scontrol.

Container images often lack scontrol. The result is compared with Slurm's own
`scontrol show hostnames` on both Slurm versions of the test cluster.
"""

from __future__ import annotations

import random

import pytest
from slurm_cluster import SlurmCluster

from mjlab_hpc.errors import LaunchError
from mjlab_hpc.rank.context import first_host

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
]


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


# Forms Slurm never writes into SLURM_JOB_NODELIST: refused with a clear error, not guessed.
INVALID = ["", " , ", "a[1", "a]", "a[]", "a[x]", "a[1-]", "a[ 1]", "a[[1]]"]


@pytest.mark.parametrize(("expr", "expected"), VALID, ids=[repr(e) for e, _ in VALID])
def test_first_host(expr: str, expected: list[str]) -> None:
    assert first_host(expr) == expected[0]


@pytest.mark.parametrize("expr", INVALID, ids=repr)
def test_first_host_refuses_what_slurm_never_writes(expr: str) -> None:
    with pytest.raises(LaunchError, match="cannot find the master host"):
        first_host(expr)


def _scontrol_first(cluster: SlurmCluster, expr: str) -> str | None:
    proc = cluster.run(["scontrol", "show", "hostnames", "--", expr], check=False, timeout=60)
    lines = proc.stdout.splitlines() if proc.returncode == 0 else []
    return lines[0] if lines else None


# Slurm 22.05 (Debian 12's) rejects a suffix after the last bracket (`node[1-2]-ib0`), which
# 23.11 and later accept. Whenever the installed Slurm expands an expression, its first host
# is ours; from 23.11 on (the 24.11 test cluster) Slurm expands every one of them.


@pytest.mark.slurm
def test_first_host_agrees_with_scontrol(slurm_cluster: SlurmCluster) -> None:
    exprs = [e for e, _ in VALID] + _random_expressions(300)
    compared = 0
    for expr in exprs:
        slurm = _scontrol_first(slurm_cluster, expr)
        if slurm is not None:
            assert first_host(expr) == slurm, expr
            compared += 1
    least = len(exprs) if slurm_cluster.version >= "23.11" else 80
    assert compared >= least, f"only {compared} of {len(exprs)} expressions compared"
