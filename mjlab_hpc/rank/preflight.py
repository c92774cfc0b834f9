"""The health check before training (`--preflight`): each rank's device, node speed and links.

Every start (the first and each heal) runs it after the process group forms and before the
first iteration. Each rank computes a known result on its device (a fixed integer matmul whose
sum is known exactly); on CUDA it also reads the device's free memory and, where NVML is
importable, its uncorrected ECC errors and row remapping. With two nodes or more, every rank
then times a fixed small step on its device at the same moment (`compute_windows`: a node whose
CPU is throttled or stopped part of the time computes slowly, whatever its links do), the
ranks time an all-reduce of `SIZE_BYTES` over all of them (a figure for the log), and the
nodes time it in pairs around a ring (every node with both neighbours, all pairs at once):
each node's all-reduce figure is the faster of its two pairs, so only the slow node itself is
slow in both (of two nodes, with one pair, neither can be). `slow_nodes` is the rule for "far
out of line", for both figures. A failed check ends the start on every rank
(`PreflightFailed`); the ranks at fault record `preflight` with the figures, the others a
consequence, and the healer leaves those ranks' nodes out as lost nodes (docs/preemption.md).
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mjlab_hpc.rank.context import DistContext
from mjlab_hpc.rank.watchdog import FAULT_ENV, FaultInjection
from mjlab_hpc.rundir.layout import RunDir

__all__ = [
    "COMPUTE_FACTOR",
    "COMPUTE_FLOOR_S",
    "COMPUTE_STEPS",
    "FLOOR_S",
    "SIZE_BYTES",
    "SLOW_FACTOR",
    "DeviceCheck",
    "NodeFailure",
    "PreflightFailed",
    "PreflightReport",
    "check_device",
    "compute_windows",
    "known_result",
    "preflight",
    "preflight_drills",
    "slow_nodes",
]

log = logging.getLogger("mjlab_hpc")

#: The all-reduce each pair of nodes times (float32).
SIZE_BYTES = 4 << 20
#: Timed repeats after one warm-up; a node's pair figure is their median.
REPEATS = 5
#: A node is slow when its all-reduce figure is above SLOW_FACTOR times the median of the
#: other nodes' figures and above FLOOR_S (noise on a busy machine stays below it).
SLOW_FACTOR = 5.0
FLOOR_S = 0.05
#: A GPU with less free memory than this share of its total fails (another process holds it).
MIN_FREE_SHARE = 0.1
#: The compute check: a rank's figure is the seconds COMPUTE_STEPS steps (a 64x64 matmul and a
#: tanh: small kernels, dispatch-bound on CPU and GPU alike, as an RL step's are) take, the
#: median over COMPUTE_WINDOWS windows of COMPUTE_WINDOW_S. A window is at least a scheduler
#: period long (CFS quotas refill every 100 ms): a quota or a stop cycle shows in every one.
COMPUTE_STEPS = 1000
COMPUTE_WINDOWS = 3
COMPUTE_WINDOW_S = 0.1
#: Rounds of COMPUTE_WINDOWS when a node is out of line in the first (`_compute_check`).
COMPUTE_ROUNDS = 3
#: A node computes slowly when its figure (its slowest rank's) is above COMPUTE_FACTOR times
#: the median of the other nodes' and above COMPUTE_FLOOR_S (tiny figures are all noise). A
#: healthy but busy machine's ranks differ by less: one shares a core with other work a while
#: (docs/preemption.md has the figures).
COMPUTE_FACTOR = 3.0
COMPUTE_FLOOR_S = 0.02
_COMPUTE_CHUNK = 20
_COMPUTE_PAUSE_S = 0.002
# What the slow drill adds to each timed all-reduce of its node.
_DRILL_DELAY_S = 0.25
_MATRIX = 256


@dataclass(frozen=True)
class DeviceCheck:
    """One rank's device check."""

    rank: int
    """The rank."""
    node: str
    """Its node."""
    device: str
    """Its device (cpu, cuda:N)."""
    got: float
    """The sum the device computed."""
    expected: float
    """The known sum."""
    seconds: float
    """How long the computation took."""
    memory: str
    """Free and total memory of a GPU, or why it was not checked."""
    nvml: str
    """NVML's uncorrected ECC errors and row remapping, or why they were not checked."""
    problem: str | None = None
    """Why the device failed (None: it passed)."""


@dataclass(frozen=True)
class NodeFailure:
    """A node that failed the preflight check."""

    node: str
    """The node."""
    check: str
    """Which check: `device`, `compute` or `all-reduce`."""
    figures: str
    """What was measured, for people."""
    ranks: tuple[int, ...]
    """The ranks at fault: the device's or the slow ones (compute), the node's first rank
    (all-reduce: it timed the node's links)."""

    def who(self) -> str:
        """`rank 1 on node2` (`ranks 1, 3 on node2`)."""
        ranks = ", ".join(str(r) for r in self.ranks)
        return f"rank{'s' * (len(self.ranks) > 1)} {ranks} on {self.node}"


@dataclass(frozen=True)
class PreflightReport:
    """What the preflight check found, the same on every rank."""

    devices: tuple[DeviceCheck, ...]
    """Every rank's device check, by rank."""
    world_s: float | None
    """The median time of an all-reduce of SIZE_BYTES over every rank (None: one rank)."""
    allreduce_s: tuple[tuple[str, float], ...]
    """Each node's all-reduce figure (seconds), when there are two nodes or more."""
    compute_s: tuple[tuple[str, float], ...]
    """Each node's compute figure (its slowest rank's seconds for COMPUTE_STEPS steps), when
    there are two nodes or more."""
    failed: tuple[NodeFailure, ...]
    """The nodes that failed (empty: all passed)."""
    seconds: float
    """The time the check added to this start (this rank's)."""

    def summary(self) -> str:
        """One line for the log."""
        times = ", ".join(f"{n} {s * 1000:.1f} ms" for n, s in self.allreduce_s)
        size = f"all-reduce of {SIZE_BYTES >> 20} MiB"
        reduce = f"; {size} per node: {times}" if times else ""
        if self.compute_s:
            steps = ", ".join(f"{n} {s * 1000:.0f} ms" for n, s in self.compute_s)
            reduce = f"; {COMPUTE_STEPS} steps per node: {steps}{reduce}"
        if self.world_s is not None:
            reduce = f"; {size} over all ranks {self.world_s * 1000:.1f} ms{reduce}"
        worst = max(d.seconds for d in self.devices)
        return (
            f"{len(self.devices)} device(s) computed the known result (slowest {worst:.3f} s)"
            f"{reduce}; took {self.seconds:.2f} s"
        )


class PreflightFailed(RuntimeError):
    """The preflight check failed on some node: this start ends on every rank."""

    def __init__(self, report: PreflightReport, rank: int):
        self.report = report
        self.here = tuple(f for f in report.failed if rank in f.ranks)
        """The failures this rank is at fault for (empty: a consequence of others')."""
        first = (self.here or report.failed)[0]
        super().__init__(
            f"preflight: {first.who()} failed the {first.check} check: {first.figures}"
        )


def known_result(device: str, n: int = _MATRIX) -> tuple[float, float]:
    """Compute a fixed integer matmul's sum on `device`; return it and its known value.

    The entries are small integers, exact in float32 (and TF32): any other sum is a fault.
    """
    idx = torch.arange(n, dtype=torch.int64)
    a = ((idx[:, None] * 3 + idx[None, :] * 5) % 7 - 3).to(torch.float32)
    col, row = a.sum(0).tolist(), a.sum(1).tolist()
    expected = float(sum(int(c) * int(r) for c, r in zip(col, row, strict=True)))
    m = a.to(device)
    got = float((m @ m).to(torch.float64).sum().item())
    return got, expected


def _gpu_memory(device: str) -> tuple[str, str | None]:
    """Free and total memory of a CUDA device, and a problem when too little is free."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    text = f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"
    if free < MIN_FREE_SHARE * total:
        return text, f"only {text} (another process holds it)"
    return text, None


def _nvml(device: str) -> tuple[str, str | None]:
    """NVML's word on a CUDA device: uncorrected ECC errors and row remapping."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return "not checked (pynvml is not importable)", None
    try:
        pynvml.nvmlInit()
        bus = torch.cuda.get_device_properties(torch.device(device)).pci_bus_id
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        found, problems = [], []
        try:
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
            found.append(f"{ecc} uncorrected ECC error(s)")
            if ecc:
                problems.append(f"{ecc} uncorrected ECC error(s) since the driver loaded")
        except pynvml.NVMLError as exc:
            found.append(f"ECC not checked ({exc})")
        try:
            _, _, pending, failure = pynvml.nvmlDeviceGetRemappedRows(handle)
            found.append(f"row remapping pending={bool(pending)} failed={bool(failure)}")
            if pending or failure:
                problems.append("a row remapping is pending or failed (reset the GPU)")
        except pynvml.NVMLError as exc:
            found.append(f"row remapping not checked ({exc})")
        # NVML reports XID errors only as events to a listener, never after the fact.
        found.append("XID not checked (NVML gives no history)")
        return "; ".join(found), "; ".join(problems) or None
    except Exception as exc:  # a driver NVML cannot talk to: said, not fatal
        return f"not checked ({type(exc).__name__}: {exc})", None


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def check_device(rank: int, node: str, device: str, broken: bool = False) -> DeviceCheck:
    """Check this rank's device; `broken` (a drill) makes its result wrong.

    A device that raises fails the check (the other ranks wait for this one's answer).
    """
    t0 = time.perf_counter()
    got, expected = float("nan"), float("nan")
    memory, nvml = "not checked (CPU)", "not checked (CPU)"
    problems = []
    try:
        got, expected = known_result(device)
        if device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(device))
            memory, low = _gpu_memory(device)
            nvml, bad = _nvml(device)
            problems += [p for p in (low, bad) if p]
    except Exception as exc:  # a broken device raises more often than it miscounts
        problems.append(_first_line(exc))
    seconds = time.perf_counter() - t0
    if broken:
        got += 1.0
    if got != expected and expected == expected:  # (nan: it raised, said above)
        problems.insert(0, f"matmul sum {got:.0f}, expected {expected:.0f}")
    return DeviceCheck(
        rank=rank,
        node=node,
        device=device,
        got=got,
        expected=expected,
        seconds=seconds,
        memory=memory,
        nvml=nvml,
        problem="; ".join(problems) or None,
    )


def compute_windows(device: str, windows: int = COMPUTE_WINDOWS) -> list[float]:
    """This rank's compute figures: the seconds COMPUTE_STEPS steps take on `device`, in each
    of `windows` windows.

    Windows of a fixed length, not a fixed count of steps: every device spends the same time
    in the check, and each window spans a scheduler period. Each window starts after a short
    sleep: the scheduler places the rank afresh (on a busy machine, a window spent beside
    another process's work is not the next one's).
    """
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 64, generator=gen) / 8).to(device)
    x = torch.randn(64, 64, generator=gen).to(device)
    cuda = device.startswith("cuda")

    def chunk() -> None:
        nonlocal x
        for _ in range(_COMPUTE_CHUNK):
            x = torch.tanh(x @ w)
        if cuda:  # (the kernels run, not only their launches)
            torch.cuda.synchronize(torch.device(device))

    # One thread, whatever --torch-threads says: ranks compare alike, and a thread pool on a
    # busy machine would time its waits for its slowest thread, not this node's speed.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chunk()  # allocations, a first kernel
        figures = []
        for _ in range(windows):
            time.sleep(_COMPUTE_PAUSE_S)
            steps, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < COMPUTE_WINDOW_S:
                chunk()
                steps += _COMPUTE_CHUNK
            figures.append(elapsed / steps * COMPUTE_STEPS)
        return figures
    finally:
        torch.set_num_threads(threads)


def _timed_compute(device: str) -> tuple[list[float], str | None]:
    """This rank's compute figures, or none and why the device raised (the others wait for
    this rank's answer)."""
    try:
        return compute_windows(device), None
    except Exception as exc:  # a broken device
        return [], f"the compute check raised {_first_line(exc)}"


def _compute_check(
    ctx: DistContext, device: str, devices: Sequence[DeviceCheck]
) -> tuple[dict[str, float], list[NodeFailure]]:
    """Time every rank's compute at once, as in training; each node's figure (its slowest
    rank's median) and the failures.

    When a node is out of line, every rank times COMPUTE_ROUNDS - 1 more rounds and the nodes
    are judged on all their windows: a throttled node is slow in every one, while a busy
    machine's noise (a rank beside another process for a while) passes. Every rank sees the
    same figures, so all take the same number of rounds.
    """
    samples: list[list[float]] = [[] for _ in devices]
    per_node: dict[str, float] = {}
    failed: list[NodeFailure] = []
    for round_ in range(COMPUTE_ROUNDS):
        got: list[tuple[list[float], str | None]] = [([], None)] * ctx.world_size
        dist.all_gather_object(got, _timed_compute(device))
        broken = [
            NodeFailure(d.node, "device", f"{problem} (on {d.device})", (d.rank,))
            for d, (_, problem) in zip(devices, got, strict=True)
            if problem
        ]
        if broken:
            return {}, broken
        for mine, (figures, _) in zip(samples, got, strict=True):
            mine.extend(figures)
        if round_ == 0 or round_ == COMPUTE_ROUNDS - 1:
            per_node, failed = _slow_compute(devices, [statistics.median(s) for s in samples])
            if not failed:
                break
    return per_node, failed


def _slow_compute(
    devices: Sequence[DeviceCheck], figures: Sequence[float]
) -> tuple[dict[str, float], list[NodeFailure]]:
    """Each node's compute figure (its slowest rank's: training waits for it), and the nodes
    far out of line with the ranks that make them so."""
    per_node: dict[str, float] = {}
    for d, f in zip(devices, figures, strict=True):
        per_node[d.node] = max(per_node.get(d.node, 0.0), f)
    failed = []
    for n in slow_nodes(per_node, COMPUTE_FACTOR, COMPUTE_FLOOR_S):
        rest = statistics.median(v for k, v in per_node.items() if k != n)
        slow = [
            (d.rank, f)
            for d, f in zip(devices, figures, strict=True)
            if d.node == n and f > COMPUTE_FACTOR * rest
        ]
        ms = ", ".join(f"{f * 1000:.0f}" for _, f in slow)
        figures_text = (
            f"{ms} ms for {COMPUTE_STEPS} steps, the other nodes' median {rest * 1000:.0f} ms "
            f"(limit: {COMPUTE_FACTOR:g}x, and over {COMPUTE_FLOOR_S * 1000:.0f} ms)"
        )
        failed.append(NodeFailure(n, "compute", figures_text, tuple(r for r, _ in slow)))
    return per_node, failed


def slow_nodes(
    figures: Mapping[str, float], factor: float = SLOW_FACTOR, floor_s: float = FLOOR_S
) -> list[str]:
    """The nodes whose figure is far out of line: above `factor` times the median of the
    others' and above `floor_s`. One node is never out of line; of two, only one can be."""
    out = []
    for node, value in figures.items():
        others = [v for n, v in figures.items() if n != node]
        if others and value > floor_s and value > factor * statistics.median(others):
            out.append(node)
    return out


def _ring_rounds(n: int) -> list[list[tuple[int, int]]]:
    """The pairs of a ring of `n` nodes, in rounds where no node is in two pairs."""
    if n < 2:
        return []
    if n == 2:
        return [[(0, 1)]]
    edges = [(i, (i + 1) % n) for i in range(n)]
    rounds = [edges[0 : n - n % 2 : 2], edges[1 : n - n % 2 : 2]]
    if n % 2:
        rounds.append([edges[-1]])
    return rounds


def _time_allreduce(group: dist.ProcessGroup | None, device: str, delay_s: float) -> float:
    """The median of REPEATS timed all-reduces of SIZE_BYTES in `group`, after a warm-up."""
    buf = torch.ones(SIZE_BYTES // 4, dtype=torch.float32, device=device)
    times = []
    for i in range(REPEATS + 1):
        t0 = time.perf_counter()
        if delay_s:
            time.sleep(delay_s)
        dist.all_reduce(buf, group=group)
        if device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(device))
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _node_figures(
    ctx: DistContext, device: str, nodes: Sequence[str], leaders: Sequence[int], slow: bool
) -> dict[str, float]:
    """Time the ring's pairs of node leaders; return each node's figure (its faster pair).

    Every rank creates every pair's group (torch.distributed asks that of all ranks).
    """
    mine: dict[tuple[int, int], float] = {}
    for pairs in _ring_rounds(len(leaders)):
        groups = [(p, dist.new_group([leaders[p[0]], leaders[p[1]]])) for p in pairs]
        for pair, group in groups:
            if ctx.rank in (leaders[pair[0]], leaders[pair[1]]):
                mine[pair] = _time_allreduce(group, device, _DRILL_DELAY_S if slow else 0.0)
        for _, group in groups:
            dist.destroy_process_group(group)
    gathered: list[dict[tuple[int, int], float] | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    per_node: dict[str, list[float]] = {n: [] for n in nodes}
    for got in gathered:
        for (i, j), s in (got or {}).items():
            per_node[nodes[i]].append(s)
            per_node[nodes[j]].append(s)
    return {n: min(s) for n, s in per_node.items() if s}


def preflight_drills(
    injections: Sequence[FaultInjection], run: RunDir, rank: int, iteration: int
) -> tuple[str, ...]:
    """The preflight drills of MJLAB_HPC_FAULT that apply to `rank` at this start.

    `preflight-device@N` and `preflight-slow@N` apply to every start once the run has reached
    iteration N; with `once`, only to the first such start.
    """
    due = []
    for f in injections:
        if not f.kind.startswith("preflight-") or f.rank != rank or iteration < f.iteration:
            continue
        marker = run.injected(f.kind, f.iteration, rank)
        if f.once and marker.exists():
            continue
        with contextlib.suppress(OSError):
            marker.parent.mkdir(parents=True, exist_ok=True)  # (the watchdog's folder, later)
            marker.touch()
        log.warning("injecting a fault (%s=%s@%d) in the preflight", FAULT_ENV, f.kind, f.iteration)
        due.append(f.kind)
    return tuple(due)


def preflight(
    ctx: DistContext,
    device: str,
    node: str,
    drills: Sequence[str] = (),
) -> PreflightReport:
    """Run the preflight check on every rank; raise PreflightFailed where any node failed.

    `drills` are the preflight drills that apply to this rank (`preflight-device`: its device
    result is wrong; `preflight-slow`: its node's all-reduces are slow).
    """
    t0 = time.perf_counter()
    mine = check_device(ctx.rank, node, device, broken="preflight-device" in drills)
    payload = (mine, "preflight-slow" in drills)
    gathered = [payload]
    if ctx.is_distributed:
        gathered = [None] * ctx.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, payload)
    devices = tuple(g[0] for g in gathered)
    nodes = list(dict.fromkeys(d.node for d in devices))
    leaders = [min(d.rank for d in devices if d.node == n) for n in nodes]
    slow_here = any(g[1] for g in gathered if g[0].node == node)
    failed = [
        NodeFailure(d.node, "device", f"{d.problem} (on {d.device})", (d.rank,))
        for d in devices
        if d.problem
    ]
    figures: dict[str, float] = {}
    compute: dict[str, float] = {}
    if len(nodes) > 1:  # one node is never out of line: nothing to time
        compute, slow = _compute_check(ctx, device, devices)
        figures = _node_figures(ctx, device, nodes, leaders, slow_here)
        failed += slow
    world = _time_allreduce(None, device, 0.0) if ctx.is_distributed else None
    for n in slow_nodes(figures):
        rest = statistics.median(v for k, v in figures.items() if k != n)
        text = (
            f"{figures[n] * 1000:.1f} ms for {SIZE_BYTES >> 20} MiB, the other nodes' "
            f"median {rest * 1000:.1f} ms (limit: {SLOW_FACTOR:g}x, and over "
            f"{FLOOR_S * 1000:.0f} ms)"
        )
        failed.append(NodeFailure(n, "all-reduce", text, (leaders[nodes.index(n)],)))
    report = PreflightReport(
        devices=devices,
        world_s=world,
        allreduce_s=tuple(figures.items()),
        compute_s=tuple(compute.items()),
        failed=tuple(failed),
        seconds=time.perf_counter() - t0,
    )
    if report.failed:
        raise PreflightFailed(report, ctx.rank)
    return report
