"""The heal loop that ends every batch script of ours: one text, rendered from parameters.

The script submitit submits (`launch/executors.py`) and both plain-sbatch templates
(`slurm_templates/`, filled by `mjlab-hpc render`) end with `heal_loop(...)`. It starts the
ranks' srun step, watches it, forwards signals to the job's steps, calls the healer after it
and starts the next step while the healer asks for one (exit codes from `errors.py`, the
signals from `rank/signals.py`).
"""

from __future__ import annotations

from mjlab_hpc.errors import EXIT_REQUEUE, EXIT_RESTART
from mjlab_hpc.rank.context import SCRIPT_MARK_ENV, START_ENV
from mjlab_hpc.rank.signals import FORWARDED
from mjlab_hpc.rundir.layout import FAULT_SUFFIX, RANK_RECORDS_DIR
from mjlab_hpc.slurm.client import RETRY_ENV, RETRY_S, UNREACHABLE

__all__ = ["STUCK_S", "heal_loop", "heal_options"]

# Seconds srun may wait for the other ranks after one failed (--kill-on-bad-exit ends them
# within seconds).
STUCK_S = 5

# A lost node never answers srun (it waits until SlurmdTimeout, 300 s by default, marks the
# node dead; its own abort, two SIGINTs, waits MessageTimeout per signal): once a rank of this
# step recorded that it failed or hung (its fault marker, `rank<k>.<n>.fault`, newer than the
# step: found by its name, no record is read) and srun still waits after {stuck} s, the
# watcher kills srun (and its child). The step's tasks on the other nodes were already ended
# by --kill-on-bad-exit; the step itself stays until its nodes
# answer (a lost one: SlurmdTimeout), so the next one shares the nodes it held (--overlap: else
# "Requested nodes are busy" until then). Safe under `set -euo pipefail`.
_LOOP = """\
# Self-healing (mjlab_hpc): when a rank crashed or hung, record the fault in run.json and
# start the ranks again from the newest valid checkpoint while restarts remain and the failure
# is not a repeat: a new srun step in this allocation (exit {restart}; the healer prints its
# srun options: the nodes it leaves out, whose place spare nodes take, or with --min-nodes a
# step on fewer nodes), else a requeue (excluding a node the fault is attributed to); nothing
# happens after a completed or stopped run. The requeue sends this shell SIGTERM: ignored, so
# the healer can still exclude the node (the job's processes end with it under
# proctrack/cgroup).
watch_step() {{
  local ended= since hit
  since=$(date +%s)
  while sleep 1; do
    if [ -z "$ended" ]; then
      hit=$(find {logs}/{records} -maxdepth 1 -name 'rank*{fault}' -newermt "@$since" \\
        -print -quit 2>/dev/null || :)
      if [ -n "$hit" ]; then ended=$SECONDS; fi
    fi
    if [ -n "$ended" ] && [ $((SECONDS - ended)) -ge {stuck} ]; then
      for p in $(pgrep -P $$ -x srun); do pkill -KILL -P "$p" || :; kill -KILL "$p" || :; done
    fi
  done
}}
# This job as Slurm's commands name it: an array element is <array>_<index> (one element's
# SLURM_JOB_ID is the array's id, which names every element).
job=${{SLURM_ARRAY_JOB_ID:+${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID:-}}}}
job=${{job:-$SLURM_JOB_ID}}
# A signal to this shell (scancel --batch, or --full) means what it means to the ranks: it
# goes on to the job's steps (docs/preemption.md, "Signals"); the shell waits on.
forward() {{
  for sig in {signals}; do trap "scancel --signal=$sig $job 2>/dev/null || :" $sig; done
}}
# slurmctld away (a restart, a failover): srun and the requeue below try again for up to
# ${retry_env} s (whole seconds; {retry_s} by default), with backoff. srun's own words go to
# the job's output and to $said: an srun that found no slurmctld before any rank started
# ("Unable to confirm allocation", "Unable to create step") is no fault and no restart.
retry=${{{retry_env}:-{retry_s}}}
retry=${{retry%%.*}}
unreachable='{unreachable}'
no_step='Unable to (confirm allocation|create step).*'
said=$(mktemp)
trap 'rm -f "$said"' EXIT
requeue() {{
  local out since=$SECONDS
  while ! out=$(scontrol requeue "$job" 2>&1); do
    echo "$out" >&2
    grep -qE "$unreachable" <<<"$out" || return 1
    if [ $((SECONDS - since)) -ge "${{retry:-0}}" ]; then
      echo "mjlab-hpc: slurmctld unreachable for $retry s ({retry_env}): requeue gave up" >&2
      return 1
    fi
    sleep 5
  done
}}
# Before srun tries again: slurmctld answers (within the bound), and the job's earlier steps
# have ended there (up to 10 s; a lost node's stays): an srun asking before waits in Slurm's
# own retry ("step creation still disabled", a minute or more on 24.11).
back() {{
  local steps waited=0
  until steps=$(squeue -h -s -j "$job" -o %i 2>/dev/null); do
    [ $((SECONDS - away)) -lt "${{retry:-0}}" ] || return 0
    sleep $pause
    pause=$((pause < 5 ? pause * 2 : 10))
  done
  while grep -qE "^$job[.][0-9]+$" <<<"$steps" && [ $((waited += 1)) -le 10 ]; do
    sleep 1
    steps=$(squeue -h -s -j "$job" -o %i 2>/dev/null) || :
  done
}}
# Our commands below keep the _MJLAB_HPC_* variables this script sets, and drop a person's.
export {mark}="$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"
again=
away=
pause=1
n=0
while :; do
  began=$SECONDS
  forward
  # This srun step's name, in its ranks' first log line: the healer finds them by it.
  export {start_env}="$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}.$((n += 1))"
  watch_step &
  watcher=$!
  ranks=0
  exec {{to_said}}> >(exec tee "$said" >&2)
  teed=$!
  # shellcheck disable=SC2086 # $again: srun options, or nothing
  srun {srun_options} $again {command} 2>&$to_said &
  step=$!
  while kill -0 $step 2>/dev/null; do wait $step || :; done
  wait $step || ranks=$?
  kill $watcher 2>/dev/null || :
  exec {{to_said}}>&-
  wait $teed || :
  if [ "$ranks" -ne 0 ] && grep -qsE "$no_step($unreachable)" "$said"; then
    away=${{away:-$SECONDS}}
    if [ $((SECONDS - away)) -lt "${{retry:-0}}" ]; then
      echo "mjlab-hpc: srun could not reach slurmctld; no rank started, trying again" >&2
      back
      continue
    fi
    echo "mjlab-hpc: slurmctld unreachable for $retry s ({retry_env}): srun gave up" >&2
  fi
  away=
  pause=1
  trap '' TERM
  status=0
  options=$({hpc} heal --run-dir {run_dir} --exit-code $ranks \\
    --elapsed-s $((SECONDS - began)) --max-restarts {max_restarts}{heal_options}) || status=$?
  [ "$status" -eq {restart} ] || break
  again="--overlap $options"
done
# A requeue that the ranks or the healer asked for where Slurm's commands are missing (exit
# {requeue}: a container image without them) is done here, in the batch shell, which has them.
if [ "$status" -eq {requeue} ]; then requeue && status=0; fi
exit "$status"
"""


def heal_options(step_nodes: int | None, min_nodes: int | None, tasks_per_node: int) -> str:
    """Return the healer's options for the shape of a step: a spare's or --min-nodes's.

    `step_nodes`: the nodes of a step (None: all of the allocation's); `min_nodes`: the fewest
    it may go on with, `tasks_per_node` ranks each.
    """
    options = f" --nodes {step_nodes}" if step_nodes else ""
    if min_nodes is not None:
        options += f" --min-nodes {min_nodes} --tasks-per-node {tasks_per_node}"
    return options


def heal_loop(
    *,
    srun_options: str,
    command: str,
    hpc: str,
    run_dir: str,
    logs: str,
    max_restarts: int,
    heal_options: str = "",
) -> str:
    """Return the loop that ends a batch script, as shell text.

    Every argument is shell text, already quoted: `srun_options` and `command` start the
    ranks (`srun {srun_options} {the healer's options} {command}`); `hpc` runs `mjlab-hpc`
    where the healer runs (plain, in the Apptainer image, a pyxis step); `run_dir` is the
    run directory given to the healer, `logs` the directory of the ranks' logs; `heal_options`
    the healer's options for the step's shape (`heal_options()`).
    """
    return _LOOP.format(
        srun_options=srun_options,
        command=command,
        hpc=hpc,
        run_dir=run_dir,
        logs=logs,
        max_restarts=max_restarts,
        heal_options=heal_options,
        fault=FAULT_SUFFIX,
        records=RANK_RECORDS_DIR,
        stuck=STUCK_S,
        restart=EXIT_RESTART,
        requeue=EXIT_REQUEUE,
        mark=SCRIPT_MARK_ENV,
        start_env=START_ENV,
        signals=" ".join(FORWARDED),
        retry_env=RETRY_ENV,
        retry_s=round(RETRY_S),
        unreachable="|".join(UNREACHABLE),
    )
