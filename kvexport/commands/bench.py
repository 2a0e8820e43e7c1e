"""`kvexport bench`: the benchmarks of a config or a built artifact."""

from __future__ import annotations

from pathlib import Path

import click

from kvexport.commands.arguments import write_json
from kvexport.commands.interrupts import handle_errors
from kvexport.commands.params import WritablePath
from kvexport.commands.stderr_filter import aoti_errors_filtered_unless_verbose
from kvexport.options import BenchOptions


def _lengths(ctx, param, value: str) -> list[int]:
    """--lengths: comma-separated history lengths, each >= 1, swept in ascending order once each."""
    try:
        lengths = sorted({int(v) for v in value.split(",")})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not lengths or lengths[0] < 1:
        raise click.BadParameter("lengths must be >= 1")
    return lengths


@click.command()
@click.argument("target", type=click.Path(path_type=Path))
@click.option("--json", "json_path", type=WritablePath(), help="Write the results as JSON.")
@click.option("--plot", "plot_path", type=WritablePath(), help="Write latency vs history as PNG.")
@click.option(
    "--lengths",
    default=",".join(map(str, BenchOptions.lengths)),
    show_default=True,
    callback=_lengths,
    help="Cached history events L to sweep.",
)
@click.option(
    "--warmup", type=click.IntRange(min=0), default=BenchOptions.warmup, show_default=True, help="Untimed repetitions."
)
@click.option(
    "--repeats", type=click.IntRange(min=1), default=BenchOptions.repeats, show_default=True, help="Timed repetitions."
)
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

    results = run_benchmarks(target, BenchOptions(lengths=tuple(lengths), warmup=warmup, repeats=repeats), checkpoint)
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
