"""`kvexport run` and `kvexport score`: a request file scored through an artifact's package, a
generated batch through the eager model."""

from __future__ import annotations

from pathlib import Path

import click

from kvexport.commands.arguments import artifact_argument, config_argument, remote_options, remote_url
from kvexport.commands.interrupts import handle_errors
from kvexport.commands.params import WritablePath
from kvexport.commands.stderr_filter import aoti_errors_filtered_unless_verbose
from kvexport.errors import UserError
from kvexport.options import SampleOptions


@click.command()
@artifact_argument
@click.option(
    "--requests",
    "requests_path",
    type=click.Path(path_type=Path),
    required=True,
    help="torch.save'd list of request batches (dicts of int64 tensors).",
)
@click.option(
    "--output",
    "output_path",
    type=WritablePath(),
    required=True,
    help="File to write each batch's status, logits and row users to (format above).",
)
@remote_options
@handle_errors
@aoti_errors_filtered_unless_verbose
def run(
    out: Path,
    requests_path: Path,
    output_path: Path,
    remote: str | None,
    remote_write: str,
    remote_password_file: Path | None,
) -> None:
    """Score a request file through OUT's package, in order (the cache carries across batches).

    Every batch is validated before any runs (a malformed one: nothing runs, no output). A batch the
    package refuses (say, KV cache capacity exceeded) is recorded and the next batches still run.

    \b
    --output is a torch.save'd list, one dict per batch in request order
    (read it with torch.load(F, weights_only=True)):
      status    "ok", or the one-line error that refused the batch
      logits    float32 [sum(num_candidates), num_tasks]; None when refused
      user_ids  int64 [sum(num_candidates)]: the user of each logits row

    Exit 0 when every batch is ok; 2 when any was refused (the file is still written) or the input
    is unusable.
    """
    from kvexport.commands.request_file import OK, score_request_file

    results = score_request_file(
        out, requests_path, output_path, remote=remote_url(remote, remote_password_file), remote_write=remote_write
    )
    failed = [index for index, result in enumerate(results) if result["status"] != OK]
    click.echo(f"scored {len(results) - len(failed)}/{len(results)} batches -> {output_path}")
    if failed:
        raise UserError(
            f"batch {failed[0]}: {results[failed[0]]['status']} ({len(failed)} of {len(results)} "
            f"batches refused; each batch's status is in {output_path})"
        )


@click.command()
@config_argument
@click.option("--checkpoint", type=click.Path(path_type=Path), help="Weights to load (default: seeded init).")
@click.option(
    "--batch-size", type=int, default=SampleOptions.num_users, show_default=True, help="Users in the generated batch."
)
@click.option("--seed", type=int, default=SampleOptions.seed, show_default=True, help="Seed of the generated batch.")
@handle_errors
def score(config: Path, checkpoint: Path | None, batch_size: int, seed: int) -> None:
    """Score a generated batch with the eager model (full recompute) and print the logits' shape."""
    from kvexport.config import load_config
    from kvexport.model import score_sample

    cfg = load_config(config)
    if not 1 <= batch_size <= cfg.serving.max_batch_size:
        raise UserError(f"--batch-size must be in 1..{cfg.serving.max_batch_size}, got {batch_size}")
    logits = score_sample(cfg, checkpoint, SampleOptions(num_users=batch_size, seed=seed))
    click.echo(f"logits: {tuple(logits.shape)} {logits.dtype} for {batch_size} users")
