"""kvexport command line: parses arguments and calls library functions, nothing more.

Commands import their library modules when they run, so `kvexport --help` does not pay for torch.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import click

from kvexport import __version__
from kvexport.commands.arguments import (
    write_json,
)
from kvexport.commands.build import build, inspect
from kvexport.commands.config import init_checkpoint, show_config
from kvexport.commands.importing import import_checkpoint
from kvexport.commands.interrupts import handle_errors
from kvexport.commands.params import (
    WritablePath,
)
from kvexport.commands.score import run, score
from kvexport.commands.serve import serve, triton_repo
from kvexport.commands.stderr_filter import aoti_errors_filtered_unless_verbose
from kvexport.commands.verify import replay, soak, verify

log = logging.getLogger("kvexport")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvexport")
@click.option("-v", "--verbose", is_flag=True, help="Log debug detail and show tracebacks.")
def main(verbose: bool) -> None:
    """Export an HSTU ranking model with a user-history KV cache to an AOTInductor package,
    and prove that the package computes what the model computes."""
    # Only kvexport's own loggers go down to DEBUG: torch, filelock and friends stay at WARNING.
    logging.basicConfig(
        level=logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s",
        stream=sys.stderr,
    )
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        # torch's own deprecation chatter during export/compile says nothing to a kvexport user.
        warnings.filterwarnings("ignore", category=FutureWarning)


def _lengths(ctx, param, value: str) -> list[int]:
    try:
        lengths = sorted({int(v) for v in value.split(",")})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not lengths or lengths[0] < 1:
        raise click.BadParameter("lengths must be >= 1")
    return lengths


@main.command()
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--json", "json_path", type=WritablePath(), help="Write the results as JSON.")
@click.option("--plot", "plot_path", type=WritablePath(), help="Write latency vs history as PNG.")
@click.option(
    "--lengths",
    default="64,256,1024,4096",
    show_default=True,
    callback=_lengths,
    help="Cached history events L to sweep.",
)
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed repetitions.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="Timed repetitions.")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="The checkpoint an artifact TARGET was built from.")
@handle_errors
@aoti_errors_filtered_unless_verbose
def bench(
    target: Path,
    json_path: Path | None,
    plot_path: Path | None,
    lengths: list[int],
    warmup: int,
    repeats: int,
    checkpoint: Path | None,
) -> None:
    """Benchmark TARGET (a config, built here cold and warm, or a built artifact)."""
    from kvexport.bench.run import plot, run_benchmarks

    results = run_benchmarks(target, lengths, warmup, repeats, checkpoint)
    for key in (
        "cache_speedup",
        "package_speedup_vs_eager",
        "cpp_over_python_latency",
        "build_seconds_cold",
        "build_seconds_warm",
        "bytes_per_cached_token",
    ):
        click.echo(f"{key:>26}: {results[key]}")
    if json_path:
        write_json(json_path, results)
    if plot_path:
        plot(results, plot_path)


main.add_command(show_config)
main.add_command(init_checkpoint)

main.add_command(import_checkpoint)

main.add_command(build)
main.add_command(inspect)

main.add_command(verify)
main.add_command(replay)
main.add_command(soak)

main.add_command(run)
main.add_command(score)

main.add_command(serve)
main.add_command(triton_repo)
