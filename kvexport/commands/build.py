"""`kvexport build` and `kvexport inspect`: an artifact exported from a config, and what one holds."""

from __future__ import annotations

from pathlib import Path

import click

from kvexport.commands.arguments import config_argument
from kvexport.commands.interrupts import handle_errors


@click.command()
@config_argument
@click.option(
    "-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="Artifact directory to create."
)
@click.option("--checkpoint", type=click.Path(path_type=Path), help="Weights to load (default: seeded init).")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    help="Device the package runs on (default: the config's serving.device).",
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option(
    "--step-program/--no-step-program",
    default=None,
    help="Also compile step.pt2, the request's device part that kvexport's hosts replay as CUDA "
    "graphs (default: for CUDA packages only).",
)
@handle_errors
def build(
    config: Path, out: Path, checkpoint: Path | None, device: str | None, force: bool, step_program: bool | None
) -> None:
    """Export CONFIG's KV-cached model to OUT/ (model.pt2, lib/, trace/, manifest.json)."""
    from kvexport.export.build import build_artifact

    build_artifact(config, out, checkpoint=checkpoint, device=device, force=force, step_program=step_program)


@click.command()
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@handle_errors
def inspect(target: Path, as_json: bool) -> None:
    """Show metadata, signature, dims, required libraries, sizes and versions of OUT or a model.pt2."""
    import json

    from kvexport.commands.describe import describe
    from kvexport.serving.signature import from_package_signature

    info = describe(target)
    serving = from_package_signature(info["name"], info["signature"])
    if serving:  # kvexport serve's signature, right after the package's
        items = list(info.items())
        after = [key for key, _ in items].index("signature") + 1
        info = dict([*items[:after], ("serving_signature", serving), *items[after:]])
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        if key == "signature" and value:
            click.echo(_format_signature(value))
            continue
        if key == "serving_signature":
            click.echo(_format_serving_signature(value))
            continue
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        click.echo(f"{key:>20}: {value}")


def _format_signature(signature: dict) -> str:
    """One line per input and for the output: name, dtype, shape and (packages since inputs stay on
    the host) device."""

    def line(label: str, spec: dict) -> str:
        shape = ", ".join(str(d) for d in spec["shape"])
        device = f" on {spec['device']}" if "device" in spec else ""
        return f"{label:>20}{':' if label else ' '} {spec['name']:<16} {spec['dtype']:<8} [{shape}]{device}"

    lines = [line("inputs" if i == 0 else "", spec) for i, spec in enumerate(signature["inputs"])]
    return "\n".join([*lines, line("output", signature["output"])])


def _format_serving_signature(serving: dict) -> str:
    """`kvexport serve`'s Triton model: one user per request (each tensor a batch of one)."""

    def line(label: str, spec: dict) -> str:
        shape = ", ".join(str(d) for d in spec["shape"])
        return f"{label:>20}{':' if label else ' '} {spec['name']:<16} {spec['datatype']:<8} [{shape}]"

    head = f"{'serving':>20}: Triton model {serving['model']}, one user per request (kvexport serve)"
    lines = [line("serving inputs" if i == 0 else "", spec) for i, spec in enumerate(serving["inputs"])]
    return "\n".join([head, *lines, line("serving output", serving["output"])])
