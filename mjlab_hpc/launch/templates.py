"""sbatch templates for people who prefer plain `sbatch`, filled from the same SubmitSpec as
`mjlab-submit` (`mjlab-hpc render TEMPLATE ...`). The templates ship inside the package
(`slurm_templates/*.sbatch` in the repository, `mjlab_hpc/slurm_templates/` installed).

A template is a shell script with `{{NAME}}` placeholders. Values are shell-quoted here, so no
user string (a run name with `;` or `$(...)`) can run a command. A line holding a placeholder
whose value is None (an option the user did not set) is left out.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from importlib import resources
from pathlib import Path

from mjlab_hpc.errors import SpecError
from mjlab_hpc.spec import ResolvedSpec, SubmitSpec, train_cli_args
from mjlab_hpc.validate import validate_submit
from mjlab_hpc.validate.rules import sbatch_options

__all__ = [
    "TEMPLATE_NAMES",
    "read_template",
    "render",
    "render_template",
    "template_context",
]

TEMPLATE_NAMES = ("train", "train_apptainer")
_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


def read_template(name: str) -> str:
    """A template's text, by name (`train`, `train_apptainer`: shipped inside the package, so
    an installed wheel has them) or by path."""
    path = Path(name)
    if path.is_file():
        return path.read_text()
    if name in TEMPLATE_NAMES:
        return (resources.files("mjlab_hpc") / "slurm_templates" / f"{name}.sbatch").read_text()
    raise SpecError(
        "TEMPLATE",
        f"no template {name!r}: use one of {', '.join(TEMPLATE_NAMES)} or a path to a file",
    )


def template_context(spec: SubmitSpec, resolved: ResolvedSpec) -> dict[str, str | None]:
    """Placeholder values for a validated spec, already quoted for the shell."""
    q = shlex.quote
    log_root = Path(spec.train.log_root).resolve()

    def opt(value: object) -> str | None:
        return None if value is None else q(str(value))

    extra = [
        f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={q(str(v))}"
        for k, v in sbatch_options(spec).items()
    ]
    return {
        "JOB_NAME": q(spec.name),
        "NODES": str(spec.nodes),
        "TASKS_PER_NODE": str(spec.ranks_per_node),
        "GPUS_PER_NODE": str(spec.gpus_per_node) if spec.gpus_per_node > 0 else None,
        "CPUS_PER_TASK": opt(spec.cpus_per_task),
        "MEM": opt(spec.mem),
        "PARTITION": opt(spec.partition),
        "ACCOUNT": opt(spec.account),
        "QOS": opt(spec.qos),
        "CONSTRAINT": opt(spec.constraint),
        "EXCLUSIVE": "--exclusive" if spec.exclusive else None,
        "TIME": q(spec.time),
        "SIGNAL": f"{spec.preempt_signal}@{spec.signal_delay_s}",
        "BATCH_LOG": "slurm-%x-%j.out",
        "SBATCH_EXTRA": "\n".join(extra) or None,
        "SETUP": "\n".join(spec.setup) or None,  # shell lines by design: not quoted
        "LOG_ROOT": q(str(log_root)),
        "EXPERIMENT": q(resolved.experiment_name),
        "RUN_NAME": q(spec.train.run_name),
        "TRAIN_ARGS": " ".join(q(a) for a in train_cli_args(spec.train)),
        "MAX_RESTARTS": str(spec.train.max_restarts),
        "IMAGE": opt(Path(spec.container).resolve() if spec.container else None),
        "NV": "--nv" if spec.gpus_per_node > 0 else "",
    }


def render_template(text: str, context: dict[str, str | None]) -> str:
    """Fill `{{NAME}}` placeholders; drop lines whose placeholder is None."""
    out = []
    for line in text.splitlines():
        names = _PLACEHOLDER.findall(line)
        unknown = [n for n in names if n not in context]
        if unknown:
            raise SpecError("TEMPLATE", f"unknown placeholder {{{{{unknown[0]}}}}} in: {line}")
        if any(context[n] is None for n in names):
            continue
        out.append(_PLACEHOLDER.sub(lambda m: str(context[m.group(1)]), line))
    return "\n".join(out) + "\n"


def render(template: str, spec: SubmitSpec) -> str:
    """The filled template for `spec` (validated first, as a Slurm job that is not submitted
    here: rendering works on a machine without Slurm)."""
    spec = dataclasses.replace(spec, executor="slurm", dry_run=True)
    resolved = validate_submit(spec)
    text = read_template(template)
    if "{{IMAGE}}" in text and spec.container is None:
        raise SpecError("--container", f"template {template!r} needs an image: --container IMAGE")
    return render_template(text, template_context(spec, resolved))
