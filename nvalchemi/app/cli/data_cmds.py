"""``data convert`` (extxyz / ASE db -> zarr store), ``data check`` and ``data stats``."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from typing import Any

import click

from nvalchemi.app.cli._app import debug_option, main
from nvalchemi.app.cli._console import err_console, print_table
from nvalchemi.app.cli._errors import CLIError
from nvalchemi.app.cli._options import json_option, max_structures_option

__all__ = ["data"]


@contextlib.contextmanager
def _progress(description: str) -> Iterator[Any]:
    """A rich progress bar on stderr; yields ``update(done, total)``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    console = err_console()
    columns = [
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield update


class _Stopped(BaseException):
    """A stop signal during ``data convert`` (a ``BaseException``: no handler eats it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


class _StopSignals:
    """``SIGINT``, ``SIGTERM`` and ``SIGHUP`` while converting: stop cleanly, soon.

    Before the store is written (:meth:`writing`) a signal raises :class:`_Stopped` at
    once. While it is written, the first signal is remembered and raised at the next
    :meth:`check` (after a chunk is written: never in the middle of zarr's writes, which
    run on zarr's own thread and would go on filling the partial store while it is
    removed); a second one raises at once.
    """

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferred = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def writing(self) -> None:
        self.deferred = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None or not self.deferred:
            raise _Stopped(signum)
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise _Stopped(self.signum)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}  # a signal during the final swap: the store is whole, kept


def _label_keys(ctx: Any, param: Any, pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        label, sep, key = pair.partition("=")
        if not sep or label not in ("energy", "forces", "stress", "virials") or not key:
            raise CLIError(
                f"--label-key expects LABEL=KEY with LABEL one of energy, forces, stress, "
                f"virials; got {pair!r}",
                fix="e.g. --label-key energy=REF_energy",
            )
        out[label] = key
    return out


def _label_key_option(help: str) -> Any:
    return click.option("--label-key", "label_keys", multiple=True, callback=_label_keys, help=help)


@main.group()
def data() -> None:
    """Convert data sets, verify them and print their statistics."""


@data.command(
    "convert",
    epilog="""\b
Examples:
  nvalchemi-training data convert data/train.extxyz data/train.zarr --cutoff 5
  nvalchemi-training data convert a.extxyz b.db data/all.zarr --label-key energy=REF_energy
""",
)
@click.argument("inputs", nargs=-1, required=True)
@click.argument("output")
@click.option(
    "--cutoff",
    type=click.FloatRange(min=0, min_open=True),
    help="Also store neighbour lists for this cutoff (Å).",
)
@click.option("--half-list", is_flag=True, help="Store each pair once (with --cutoff).")
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    help="Structures written per append (default: about half a million atoms at a time; the "
    "first write sets the store's shard size, so large stores want large writes).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float64"]),
    default="float32",
    show_default=True,
    help="dtype of positions, cells, forces and stresses in the store; total energies and "
    "virials are always stored in float64.",
)
@_label_key_option("Where a label lives in the input, e.g. energy=REF_energy (repeatable).")
@max_structures_option("Convert only the first N structures of each input.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it is a zarr store.")
@debug_option
def convert(inputs: tuple[str, ...], output: str, **options: Any) -> None:
    """Convert extxyz / ASE db files (INPUTS) into one zarr store (OUTPUT).

    The store is written next to OUTPUT and moved into place when complete, so an
    interrupted conversion leaves nothing half-written; --overwrite replaces only a
    zarr store (never an input, a directory holding one, or any other file).
    """
    from nvalchemi.data.convert import check_output, convert_to_zarr, open_inputs

    if options["half_list"] and options["cutoff"] is None:
        raise CLIError("--half-list needs --cutoff", fix="add --cutoff 5.0 (or drop --half-list)")
    check_output(inputs, output, overwrite=options["overwrite"])
    console = err_console()
    stops = _StopSignals()
    try:
        with stops:
            readers = open_inputs(
                inputs,
                dtype=options["dtype"],
                label_keys=options["label_keys"],
                max_structures=options["max_structures"],
            )
            with _progress(f"writing {output}") as update:

                def progress(done: int, total: int) -> None:
                    update(done, total)
                    stops.check()  # between chunks: no write of the store is in flight

                stops.writing()
                summary = convert_to_zarr(
                    readers,
                    output,
                    cutoff=options["cutoff"],
                    half_list=options["half_list"],
                    chunk_size=options["chunk_size"],
                    progress=progress,
                    overwrite=options["overwrite"],
                )
    except _Stopped as stop:
        console.print(
            f"Stopped by {stop.name}: {output} was not written (the partial store was removed; "
            f"an existing {output} is as it was).",
            markup=False,
            soft_wrap=True,
        )
        raise SystemExit(128 + stop.signum) from None
    for leftover in summary["removed_leftovers"]:
        console.print(
            f"Removed {leftover}, the partial store of a conversion that was killed.",
            markup=False,
            soft_wrap=True,
        )
    _print_warnings(console, summary["warnings"])
    text = f"Wrote {summary['structures']:,} structures ({summary['atoms']:,} atoms) to {output}"
    if "edges" in summary:
        text += (
            f" with {summary['edges']:,} neighbour pairs (cutoff {summary['neighbor_cutoff']} Å)"
        )
    console.print(text)


def _print_warnings(console: Any, warnings: list[str], shown: int = 10) -> None:
    for warning in warnings[:shown]:
        console.print(f"warning: {warning}", markup=False, soft_wrap=True)
    if len(warnings) > shown:
        console.print(f"warning: ... and {len(warnings) - shown:,} more", markup=False)


@data.command(
    "check",
    epilog="""\b
Examples:
  nvalchemi-training data check data/train.zarr
  nvalchemi-training data check data/*.extxyz --json > check.json
""",
)
@click.argument("paths", nargs=-1, required=True)
@_label_key_option("Where a label lives in an extxyz/db input, e.g. energy=REF_energy.")
@json_option("the reports")
@debug_option
def check(paths: tuple[str, ...], label_keys: dict[str, str], as_json: bool) -> None:
    """Verify data end to end (run it after copying a store).

    Reads every chunk of every array of a zarr store (missing, truncated or undecodable
    chunk files) and every structure of any source (shapes, dtypes, finite values,
    atomic numbers). Exit status 1 when anything is wrong.
    """
    from nvalchemi.data.inspect import check_data
    from nvalchemi.data.sources import open_reader

    console = err_console()
    reports, found = [], 0
    for path in paths:
        reader = open_reader(path, field="PATH", label_dtype="float64", label_keys=label_keys)
        try:
            with _progress(f"checking {path}") as update:
                report = check_data(reader, progress=update)
        finally:
            reader.close()
        reports.append({"path": path, **report})
        found += len(report["problems"])
        _print_check(console, path, report)
    if as_json:
        click.echo(json.dumps(reports, indent=2))
    if found:
        raise CLIError(
            f"{found:,} problem(s) found (listed above)",
            field="PATH",
            fix="copy a damaged store again from its source (or rewrite it with `data convert`); "
            "fix or drop the structures listed",
        )


def _print_check(console: Any, path: str, report: dict[str, Any]) -> None:
    chunks = "" if report["chunks"] is None else f", {report['chunks']:,} chunks read"
    head = (
        f"{path}: {report['structures_valid']:,} of {report['structures']:,} structures valid "
        f"({report['atoms']:,} atoms){chunks}"
    )
    console.print(head, markup=False, soft_wrap=True)
    for warning in report["warnings"]:
        console.print(f"warning: {warning}", markup=False, soft_wrap=True)
    shown = report["problems"][:20]
    for problem in shown:
        console.print(f"  problem: {problem}", markup=False, soft_wrap=True)
    if len(report["problems"]) > len(shown):
        console.print(f"  ... and {len(report['problems']) - len(shown):,} more", markup=False)
    if not report["problems"]:
        console.print(f"{path}: OK", markup=False)


@data.command(
    "stats",
    epilog="""\b
Examples:
  nvalchemi-training data stats data/train.extxyz
  nvalchemi-training data stats data/train.zarr --max-structures 1000 --json
""",
)
@click.argument("paths", nargs=-1, required=True)
@max_structures_option()
@_label_key_option("Where a label lives in an extxyz/db input, e.g. energy=REF_energy.")
@click.option(
    "--group-by",
    default="config_type",
    show_default=True,
    help="extxyz/db info key whose values group the structures (the groups table).",
)
@json_option("the statistics")
@debug_option
def stats(
    paths: tuple[str, ...],
    max_structures: int | None,
    label_keys: dict[str, str],
    group_by: str,
    as_json: bool,
) -> None:
    """Counts, elements, label statistics and suggested per-element reference energies.

    Also the structure groups (config_type) with their counts and the weights read from the
    data (config_weight, ...). Says when the data has stress labels (``train init`` then adds
    the stress loss)."""
    from nvalchemi.data.inspect import absent_chunk_warning, data_statistics
    from nvalchemi.data.sources import open_reader

    readers = [
        open_reader(
            p,
            field="PATH",
            label_dtype="float64",
            max_structures=max_structures,
            label_keys=label_keys,
        )
        for p in paths
    ]
    try:
        for reader in readers:
            warning = absent_chunk_warning(reader)
            if warning:
                err_console().print(f"warning: {warning}", markup=False, soft_wrap=True)
        with _progress("reading") as update:
            result = data_statistics(readers, progress=update, group_by=group_by)
    finally:
        for reader in readers:
            reader.close()
    _print_stats(result)
    if as_json:
        click.echo(json.dumps(result, indent=2))


def _print_stats(result: dict[str, Any]) -> None:
    console = err_console()
    _print_warnings(console, [pair["text"] for pair in result["close_pairs"]])
    sizes = result["atoms_per_structure"]
    rows = [
        ("structures", result["structures"]),
        ("atoms", result["atoms"]),
        ("atoms per structure", f"{sizes['min']} - {sizes['max']} (mean {sizes['mean']:.1f})"),
        ("periodic structures", result["periodic_structures"]),
    ]
    rows += [(f"with {label}", count) for label, count in result["labels"].items()]
    if "energy_per_atom" in result:
        e = result["energy_per_atom"]
        rows.append(
            (
                "energy per atom (eV)",
                f"{e['mean']:.4f} ± {e['std']:.4f} [{e['min']:.4f}, {e['max']:.4f}]",
            )
        )
    if "forces" in result:
        rows.append(("force component RMS (eV/Å)", result["forces"]["component_rms"]))
        rows.append(("largest force (eV/Å)", result["forces"]["max_norm"]))
    if "stress" in result:
        s = result["stress"]
        rows.append(
            ("stress component (meV/Å³)", f"{1000 * s['mean']:.3g} ± {1000 * s['std']:.3g}")
        )
    print_table(console, "Data set", ["", "value"], rows)
    energies = result.get("reference_energies", {})
    print_table(
        console,
        "Elements",
        ["element", "atoms", "structures", "E0 (eV)"],
        [
            (
                symbol,
                v["atoms"],
                v["structures"],
                "-" if symbol not in energies else f"{energies[symbol]:.4f}",
            )
            for symbol, v in result["elements"].items()
        ],
    )
    if energies:
        console.print("E0: suggested per-element reference energies (least squares on the totals)")
    if result.get("groups"):
        total = result["structures"]
        print_table(
            console,
            f"Groups ({result['group_by']})",
            ["group", "structures", "share"],
            [(g, n, f"{100 * n / total:.1f} %") for g, n in result["groups"].items()],
        )
    for name, w in result.get("weights", {}).items():
        console.print(
            f"{name}: {w['structures']:,} structures weighted other than 1 "
            f"(from {w['min']:g} to {w['max']:g}); the losses divide by the sum of the weights"
        )
    if result["labels"]["stress"]:
        console.print(
            f"stress labels: {result['labels']['stress']:,} of {result['structures']:,} "
            "structures (train init adds the stress loss and the model's stress output)"
        )
    if result.get("residual_energy_per_atom"):
        r = result["residual_energy_per_atom"]
        console.print(
            f"energy per atom after subtracting E0: std {1000 * r['std']:.1f} meV/atom "
            f"(what the model has to learn)"
        )
