"""`kvexport serve` and `kvexport triton-repo`: an artifact behind a Triton Inference Server, and the
Triton model repository that serves it."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from kvexport.commands.arguments import artifact_argument, remote_options, remote_url
from kvexport.commands.interrupts import handle_errors
from kvexport.commands.params import PORT, ArtifactDirectory
from kvexport.commands.stderr_filter import aoti_errors_filtered_unless_verbose
from kvexport.errors import UserError
from kvexport.options import RepositoryOptions, ServeOptions


def threads_option(default: int):
    """--threads N: each Triton model instance's intra-op CPU threads."""
    return click.option(
        "--threads",
        type=click.IntRange(min=1),
        default=default,
        show_default=True,
        help="Intra-op CPU threads of each model instance (torch.set_num_threads); keep "
        "instances x threads within the cores the server may use.",
    )


@click.command()
@artifact_argument
@click.option(
    "--address",
    default=ServeOptions.address,
    show_default=True,
    help="Address the HTTP, gRPC and metrics ports listen on.",
)
@click.option(
    "--http-port",
    type=PORT,
    default=ServeOptions.http_port,
    show_default=True,
    help="Triton's HTTP/REST port (KServe v2).",
)
@click.option(
    "--grpc-port", type=PORT, default=ServeOptions.grpc_port, show_default=True, help="Triton's gRPC port (KServe v2)."
)
@click.option(
    "--metrics-port",
    type=PORT,
    default=ServeOptions.metrics_port,
    show_default=True,
    help="Triton's Prometheus metrics port: its own metrics and kvexport's cache and batch counters.",
)
@click.option(
    "--batching/--no-batching",
    default=ServeOptions.batching,
    show_default=True,
    help="Merge concurrent users into one package call (--no-batching: one request per call, "
    "to measure what batching brings).",
)
@threads_option(ServeOptions.threads)
@remote_options
@handle_errors
@aoti_errors_filtered_unless_verbose
def serve(
    out: Path,
    address: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    batching: bool,
    threads: int,
    remote: str | None,
    remote_write: str,
    remote_password_file: Path | None,
) -> None:
    """Serve OUT through a Triton Inference Server (needs the serve extra: pip install 'kvexport[serve]').

    \b
    One inference request is one user, each tensor a batch of one (as `kvexport inspect OUT` prints):
      user_id [1, 1], item_ids [1, h], action_ids [1, h], context_ids [1, C], candidate_ids [1, T]
      (context_ids [1, C + 1] with an item_tower head: the query time last)
      INT64 -> logits [1, T, num_tasks] FP32
    Runs the model repository `kvexport triton-repo` writes (the artifact referenced where it is,
    in a private workspace) under the extra's tritonserver. The Triton model is named after the
    artifact. Triton's dynamic batcher merges concurrent requests (up to four times the package's
    max_batch_size users), scored in jagged package calls; two requests of one user never share a package call
    and run in the order they reach the model. A refused request gets a Triton error with its
    one-line message (HTTP 400, gRPC INVALID_ARGUMENT; a capacity refusal 503, UNAVAILABLE).
    Ready (/v2/health/ready) once the package is loaded and warmed up. SIGTERM or SIGINT: new
    requests are refused, those in flight are answered, then it exits 0.
    """
    from kvexport.serving.triton import serve as run_server

    remote = remote_url(remote, remote_password_file)

    def ready(server) -> None:
        click.echo(
            f"serving {server.model_name} from {out} (batches of up to {server.max_batch_size} users, "
            f"{server.package_batch_size} a package call): "
            f"http {address}:{http_port}, "
            f"grpc {address}:{grpc_port}, metrics {address}:{metrics_port}"
        )

    options = ServeOptions(
        address=address,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        batching=batching,
        threads=threads,
        remote=remote,
        remote_write=remote_write,
    )
    run_server(out, ready, options)
    click.echo("stopped")


@click.command("triton-repo")
@click.argument("out", type=ArtifactDirectory())
@click.option(
    "-o",
    "--output",
    "repo",
    type=click.Path(path_type=Path),
    required=True,
    help="Model repository to write (a new or empty directory).",
)
@click.option("--name", help="The Triton model's name (default: the artifact's config name).")
@click.option(
    "--instances",
    type=click.IntRange(min=1),
    default=RepositoryOptions.instances,
    show_default=True,
    help="Cache shards per GPU (or on the host, for a CPU package): each one model instance with its "
    "own cache. With more than one shard in all, the model named after the artifact holds shard 0 "
    "and sends every other request to the shard its user id hashes to, so a user's requests meet "
    "their cache.",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=RepositoryOptions.gpus,
    show_default=True,
    help="GPUs a CUDA package's shards spread over (shard i on GPU i mod N).",
)
@click.option(
    "--routing/--no-routing",
    default=RepositoryOptions.routing,
    show_default=True,
    help="Route each user to one shard (off: one model of K instances per GPU, Triton handing each "
    "request to whichever instance is free: no router hop, but a returning user finds their "
    "cache about 1/K of the time).",
)
@click.option(
    "--python-path",
    "python_path",
    multiple=True,
    type=click.Path(path_type=Path),
    help="A site directory for the Python backend's interpreter (repeatable): where torch and "
    "kvexport are installed, when that is not the interpreter's own site-packages.",
)
@click.option(
    "--this-python",
    is_flag=True,
    help="Add this Python's site-packages to --python-path (serving from this virtual environment).",
)
@click.option(
    "--batching/--no-batching",
    default=RepositoryOptions.batching,
    show_default=True,
    help="Triton's dynamic batcher merges concurrent users (off: one user per model execution).",
)
@threads_option(RepositoryOptions.threads)
@remote_options
@handle_errors
def triton_repo(
    out: Path,
    repo: Path,
    name: str | None,
    instances: int,
    gpus: int,
    routing: bool,
    python_path: tuple[Path, ...],
    this_python: bool,
    batching: bool,
    threads: int,
    remote: str | None,
    remote_write: str,
    remote_password_file: Path | None,
) -> None:
    """Write a Triton model repository serving the artifact OUT (Python backend, dynamic batching).

    Serve it with `tritonserver --model-repository REPO` where torch and kvexport are importable;
    docs/hosting.md says how. The remote tier's password goes in a file the serving host mounts
    (--remote-password-file, read when the model loads), never in the URL: Triton serves the
    model's config to any client.
    """
    from kvexport.serving import tritonserver
    from kvexport.serving.repository import Remote, write_repository

    if remote is None and remote_password_file is not None:
        raise UserError("--remote-password-file needs --remote URL")
    paths = [str(p.resolve()) for p in python_path] + (tritonserver.site_packages() if this_python else [])
    tier = Remote(remote, remote_write, remote_password_file) if remote is not None else None
    options = RepositoryOptions(instances=instances, gpus=gpus, routing=routing, batching=batching, threads=threads)
    model = write_repository(out, repo, name, options, python_path=paths, remote=tier)
    if not paths and sys.prefix != sys.base_prefix:
        click.echo(
            "warning: this Python is a virtual environment and neither --this-python nor --python-path was "
            "given: the Python backend's interpreter finds torch and kvexport only in its own "
            "site-packages",
            err=True,
        )
    click.echo(
        f"wrote {model}; serve it with {repo / 'tritonserver'} [tritonserver options] (the serve extra's "
        f"tritonserver), or tritonserver --model-repository {repo} where torch and kvexport import"
    )
