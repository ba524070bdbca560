"""``export``: a checkpoint's model as a file that runs with torch only (TorchScript)."""

from __future__ import annotations

from typing import Any

import click

from nvalchemi.app.cli._app import debug_option, main
from nvalchemi.app.cli._console import err_console, format_number
from nvalchemi.app.cli._errors import CLIError
from nvalchemi.app.cli._options import checkpoint_options, trust_options

__all__ = ["export"]

# export_model's argument names -> this command's
_FIELDS = {"path": "OUT", "format": "--format", "dtype": "--dtype", "model": "CHECKPOINT"}


@main.command(
    "export",
    epilog="""\b
Examples:
  nvalchemi-training export runs/my/checkpoints runs/my/potential.pt
  nvalchemi-training export runs/my/checkpoints cu.pt --dtype float32 --check held_out.extxyz
""",
)
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option(
    "--dtype",
    type=click.Choice(["float64", "float32"]),
    help="Precision of the exported model (default: the model's).",
)
@click.option(
    "--format",
    "export_format",
    type=click.Choice(["torchscript", "aoti"]),
    default="torchscript",
    show_default=True,
    help="torchscript (torch.jit.load); aoti (AOTInductor) is not provided yet.",
)
@click.option(
    "--check",
    "check_file",
    type=click.Path(dir_okay=True),
    help="Structures to check the export on (default: a few of the run's data).",
)
@checkpoint_options
@trust_options
@debug_option
def export(
    checkpoint: str,
    out: str,
    ema: bool,
    dtype: str | None,
    export_format: str,
    check_file: str | None,
    checkpoint_index: int | str,
    head: str | None,
    model_key: str,
    trust: bool,
    allow_imports: tuple[str, ...],
) -> None:
    """Export a checkpoint's model to OUT, a TorchScript file that needs torch only.

    The export checks itself against the model on a few structures (nothing is written
    if they disagree) and carries a metadata JSON: the model spec, units, dtype, training
    step, data files and their hashes, the run's final errors and the check's numbers.
    A committee's export also returns its calibrated spread (energy_std, forces_std,
    max_force_deviation, stress_std).

    \b
    Use the file (torch only; docs/deploy.md):
      m = torch.jit.load("potential.pt"); out = m(inputs)
      atoms.calc = NvalchemiCalculator.from_export("potential.pt")
    """
    from nvalchemi.app.export import export_checkpoint
    from nvalchemi.app.jobs.resolve import allow_user_code
    from nvalchemi.models.export import ExportError

    allow_user_code(list(allow_imports), ".", field="--allow-import")
    try:
        info = export_checkpoint(
            checkpoint,
            out,
            use_ema=ema,
            dtype=dtype,
            format=export_format,
            check_file=check_file,
            checkpoint_index=checkpoint_index,
            model_key=model_key,
            head=head,
            trust=trust,
        )
    except ExportError as exc:
        raise CLIError(exc.message, field=_FIELDS.get(exc.field, exc.field), fix=exc.fix) from None
    _summary(out, info)


def _summary(out: str, info: dict[str, Any]) -> None:
    console = err_console()
    check = info["self_check"]
    training, model = info.get("training", {}), info.get("model", {})
    worst = max(check["max_relative_error"].values())
    console.print(f"exported:   {out} (TorchScript, {info['dtype']}; runs with torch only)")
    console.print(
        f"model:      {model.get('class', '?')}, {model.get('weights', '?')} weights, "
        f"step {format_number(training.get('step'))}; cutoff {info['cutoff']:g} Å, "
        f"elements Z={info['atomic_numbers']}"
    )
    committee = info.get("committee")
    if committee:
        factors = ", ".join(f"{k} {v:.3g}" for k, v in committee["calibration_factors"].items())
        console.print(
            f"committee:  {committee['size']} members; outputs their mean and calibrated "
            f"spread (energy_std, forces_std, max_force_deviation, stress_std; factors "
            f"{factors})",
            soft_wrap=True,
        )
    console.print(
        f"self-check: eager and exported agree on {len(check['structures'])} structures to "
        f"{worst:.2g} relative (tolerance {check['tolerance']:g}); "
        f"structures: {check.get('source', 'synthetic')}",
        soft_wrap=True,
    )
    console.print(
        "use it:     torch.jit.load(OUT)(inputs) or "
        "NvalchemiCalculator.from_export(OUT); see docs/deploy.md",
        markup=False,
    )
