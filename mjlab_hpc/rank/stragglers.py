"""Stragglers: ranks whose iterations are consistently slower than the others'.

A throttled GPU or a busy node makes one. In a synchronous job every rank's iteration takes as
long as the slowest one's, so a rank's own cost is its time outside collectives (the others
wait for it inside them). Every rank hands that over in the iteration boundary's all-gather
(`rank.stop`). `StragglerWatch` compares the ranks' medians over a window and says when the
set changes: every rank logs it, and the writer records it in run.json (`stragglers`) for
`mjlab-hpc status` and `logs`.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FLOOR_S", "RATIO", "WINDOW", "Straggler", "StragglerWatch"]

log = logging.getLogger(__name__)

WINDOW = 10
"""Iterations a rank's time is taken over (the median: one slow iteration is no straggler)."""
RATIO = 1.25
"""How much longer than the median of the other ranks' medians makes a straggler."""
FLOOR_S = 0.02
"""And by at least this many seconds per iteration (tiny iterations are all noise)."""


@dataclass(frozen=True)
class Straggler:
    """A rank that works longer per iteration than the others."""

    rank: int
    """Its rank."""
    host: str
    """Its node (SLURMD_NODENAME, else the host name)."""
    busy_s: float
    """Its median seconds per iteration outside collectives, over the window."""
    others_s: float
    """The median of the other ranks' medians."""
    since: int
    """The iteration at which it was found."""

    @property
    def ratio(self) -> float:
        """How many times the others' work per iteration it takes."""
        return self.busy_s / self.others_s if self.others_s > 0 else float("inf")

    def describe(self) -> str:
        """One line for the logs and status."""
        return (
            f"rank {self.rank} on {self.host} is {self.ratio:.2f}x slower than the other ranks "
            f"({self.busy_s:.3f} s vs {self.others_s:.3f} s of work per iteration, median of "
            f"{WINDOW}, since iteration {self.since})"
        )

    def as_dict(self) -> dict[str, Any]:
        """For run.json (`stragglers`)."""
        return {
            "rank": self.rank,
            "host": self.host,
            "busy_s": round(self.busy_s, 4),
            "others_s": round(self.others_s, 4),
            "ratio": round(self.ratio, 2),
            "since": self.since,
            "text": self.describe(),
        }


class StragglerWatch:
    """The last `WINDOW` busy times of every rank, and the stragglers among them."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = list(hosts)
        self.times: list[deque[float]] = [deque(maxlen=WINDOW) for _ in hosts]
        self.current: list[Straggler] = []

    def add(self, iteration: int, busy_s: Sequence[float]) -> bool:
        """Take one iteration's busy seconds (one per rank); whether the stragglers changed.

        When they did, `current` holds the new ones and every rank has logged them.
        """
        for times, value in zip(self.times, busy_s, strict=True):
            times.append(value)
        if len(self.hosts) < 2 or len(self.times[0]) < WINDOW:
            return False
        medians = [statistics.median(t) for t in self.times]
        order = sorted(range(len(medians)), key=medians.__getitem__)
        ranked = [medians[r] for r in order]
        found = []
        for place, rank in enumerate(order):
            mine, others = medians[rank], _median_without(ranked, place)
            if mine >= RATIO * others and mine - others >= FLOOR_S:
                kept = next((s for s in self.current if s.rank == rank), None)
                since = kept.since if kept is not None else iteration
                found.append(
                    Straggler(
                        rank=rank, host=self.hosts[rank], busy_s=mine, others_s=others, since=since
                    )
                )
        if [s.rank for s in found] == [s.rank for s in self.current]:
            self.current = found  # the same ranks, the figures now
            return False
        gone = {s.rank for s in self.current} - {s.rank for s in found}
        self.current = found
        for s in found:
            log.warning("straggler: %s", s.describe())
        for rank in sorted(gone):
            log.info(
                "straggler: rank %d on %s keeps up again (iteration %d)",
                rank,
                self.hosts[rank],
                iteration,
            )
        return True


def _median_without(ranked: Sequence[float], place: int) -> float:
    """Return the median of the sorted values `ranked` without the one at `place`.

    It costs O(1), not a sort per rank: a job may have thousands of ranks.
    """
    n = len(ranked) - 1

    def at(i: int) -> float:
        return ranked[i] if i < place else ranked[i + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
