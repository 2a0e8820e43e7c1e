"""kvexport command line: parses arguments and calls library functions, nothing more."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import click

from kvexport import __version__
from kvexport.errors import UserError

log = logging.getLogger("kvexport")


def _handle_errors(func):
    """User errors: one line on stderr and their exit code; --verbose adds the traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except UserError as exc:
            if logging.getLogger().isEnabledFor(logging.DEBUG):
                log.exception("user error")
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


config_argument = click.argument("config", type=click.Path(path_type=Path))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvexport")
@click.option("-v", "--verbose", is_flag=True, help="Log debug detail and show tracebacks.")
def main(verbose: bool) -> None:
    """Export an HSTU ranking model with a user-history KV cache to an AOTInductor package,
    and prove that the package computes what the model computes."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s",
        stream=sys.stderr,
    )
    log.setLevel(logging.DEBUG if verbose else logging.INFO)


@main.command("show-config")
@config_argument
@_handle_errors
def show_config(config: Path) -> None:
    """Check CONFIG and print it with every default filled in."""
    import yaml

    from kvexport.config import load_config

    click.echo(yaml.safe_dump(load_config(config).to_dict(), sort_keys=False), nl=False)


@main.command("init-checkpoint")
@config_argument
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Checkpoint file to write.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random initialisation.")
@_handle_errors
def init_checkpoint(config: Path, output: Path, seed: int) -> None:
    """Write a randomly initialised checkpoint (a state_dict) for CONFIG."""
    from kvexport.config import load_config
    from kvexport.model import build_model
    from kvexport.model.checkpoint import save_checkpoint

    model = build_model(load_config(config), seed=seed)
    save_checkpoint(model, output)
    click.echo(f"wrote {output} ({sum(p.numel() for p in model.parameters())} parameters)")


@main.command()
@config_argument
@click.option("--checkpoint", type=click.Path(path_type=Path), help="Weights to load (default: seeded init).")
@click.option("--batch-size", type=int, default=2, show_default=True, help="Users in the generated batch.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the generated batch.")
@_handle_errors
def score(config: Path, checkpoint: Path | None, batch_size: int, seed: int) -> None:
    """Score a generated batch with the eager model (full recompute) and print the logits' shape."""
    import torch

    from kvexport.config import load_config
    from kvexport.model import build_model, random_batch

    cfg = load_config(config)
    if not 1 <= batch_size <= cfg.serving.max_batch_size:
        raise UserError(f"--batch-size must be in 1..{cfg.serving.max_batch_size}, got {batch_size}")
    model = build_model(cfg, checkpoint)
    histories = [min(cfg.trace.max_trace_history_length, 8 * (i + 1)) for i in range(batch_size)]
    batch = random_batch(cfg.model, seed, histories, [cfg.trace.num_candidates] * batch_size)
    with torch.no_grad():
        logits = model(batch)
    click.echo(f"logits: {tuple(logits.shape)} {logits.dtype} for {batch_size} users")
