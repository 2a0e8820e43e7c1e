"""`kvexport verify`, `kvexport replay` and `kvexport soak`: proving that an artifact computes what
its model computes (its trace in Python, its trace in the C++ harness, a random workload)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvexport.commands.arguments import (
    artifact_argument,
    atol_option,
    json_option,
    remote_options,
    remote_url,
    rtol_option,
    write_json,
)
from kvexport.commands.interrupts import handle_errors
from kvexport.commands.params import Route, WritablePath
from kvexport.commands.stderr_filter import aoti_errors_filtered_unless_verbose
from kvexport.options import ReplayOptions, SoakOptions


@click.command()
@artifact_argument
@json_option
@atol_option
@rtol_option
@handle_errors
@aoti_errors_filtered_unless_verbose
def verify(out: Path, json_path: Path | None, atol: float | None, rtol: float | None) -> None:
    """Replay OUT's trace through model.pt2 in Python; exit 0 pass, 1 mismatch, 2 unusable input."""
    from kvexport.trace.report import format_report
    from kvexport.trace.verify import verify_artifact

    report = verify_artifact(out, atol, rtol).to_json()
    click.echo(format_report(report))
    if json_path:
        write_json(json_path, report)
    sys.exit(0 if report["passed"] else 1)


@click.command()
@artifact_argument
@json_option
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=ReplayOptions.repeat,
    show_default=True,
    help="Replay the trace N times (from an empty cache each time) for latency percentiles.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=ReplayOptions.threads,
    show_default=True,
    help="Threads replaying the trace concurrently through one loaded package.",
)
@atol_option
@rtol_option
@remote_options
@click.option(
    "--route",
    type=click.Choice(["model", "step", "graphs"]),
    default=ReplayOptions.route,
    show_default=True,
    help="model: model.pt2 runs each whole request (as plain hosts do); step: the harness plans each "
    "request and runs step.pt2; graphs: step.pt2 replayed as CUDA graphs (GPU artifacts).",
)
@handle_errors
def replay(
    out: Path,
    json_path: Path | None,
    repeat: int,
    threads: int,
    atol: float | None,
    rtol: float | None,
    remote: str | None,
    remote_write: str,
    remote_password_file: Path | None,
    route: str,
) -> None:
    """Replay OUT's trace with the bundled C++ harness (no Python); exit codes as verify."""
    from kvexport.trace.replay import run_replay

    if remote_password_file is not None:
        remote_url(remote, remote_password_file)  # its errors now, in the CLI's words; the harness reads it again
    options = ReplayOptions(repeat=repeat, threads=threads, atol=atol, rtol=rtol, route=route)
    sys.exit(
        run_replay(
            out, json_path, options, remote=remote, remote_write=remote_write, remote_password_file=remote_password_file
        )
    )


@click.command()
@artifact_argument
@click.option(
    "--requests",
    "num_requests",
    type=click.IntRange(min=1),
    default=SoakOptions.num_requests,
    show_default=True,
    help="Requests to send.",
)
@click.option(
    "--users",
    "num_users",
    type=click.IntRange(min=1),
    default=SoakOptions.num_users,
    show_default=True,
    help="Distinct users in the population.",
)
@click.option("--seed", type=int, default=SoakOptions.seed, show_default=True, help="Workload seed.")
@click.option(
    "--checkpoint",
    type=click.Path(path_type=Path),
    help="The checkpoint OUT was built from (needed when it was built from one).",
)
@click.option("--json", "json_path", type=WritablePath(), help="Also write the result as JSON.")
@remote_options
@click.option(
    "--route",
    type=Route(),
    default="/".join(map(str, SoakOptions.route)),
    show_default=True,
    help="Score only the requests a seeded router sends to process I of N: N soaks with one seed "
    "and one --remote soak a fleet, each user's requests landing on any of them.",
)
@handle_errors
@aoti_errors_filtered_unless_verbose
def soak(
    out: Path,
    num_requests: int,
    num_users: int,
    seed: int,
    checkpoint: Path | None,
    json_path: Path | None,
    remote: str | None,
    remote_write: str,
    remote_password_file: Path | None,
    route: tuple[int, int],
) -> None:
    """Drive OUT with a random workload under eviction; every output must equal the eager recompute."""
    from kvexport.trace.soak import soak as run_soak

    remote = remote_url(remote, remote_password_file)
    options = SoakOptions(num_requests=num_requests, num_users=num_users, seed=seed, route=route)
    report = run_soak(out, options, checkpoint, remote=remote, remote_write=remote_write)
    counters = ", ".join(f"{k} {v}" for k, v in report.counters.items())
    click.echo(
        f"requests {report.requests} (route {report.route} of {num_requests}), users {report.users}, "
        f"seed {report.seed}, {report.seconds:.1f} s"
    )
    click.echo(f"counters: {counters}")
    click.echo(f"workload: {', '.join(f'{k} {v}' for k, v in sorted(report.workload.items()))}")
    if remote and report.remote_hit_ratio is not None:
        from kvexport.ops.wrappers import redact_url

        click.echo(
            f"remote: hit ratio {report.remote_hit_ratio:.3f} ({report.counters['remote_hits']} users served "
            f"from {redact_url(remote)}, {report.counters['remote_hit_tokens']} tokens)"
        )
    verdict = (
        "PASS" if report.passed else f"FAIL ({report.mismatches} mismatches, first at request {report.first_mismatch})"
    )
    click.echo(f"worst abs error {report.worst_abs:.3e}; verdict: {verdict}")
    if json_path:
        write_json(json_path, report.to_json())
    sys.exit(0 if report.passed else 1)
