"""`kvexport show-config` and `kvexport init-checkpoint`: a config with its defaults filled in, and
a randomly initialised checkpoint for it."""

from __future__ import annotations

from pathlib import Path

import click

from kvexport.commands.arguments import config_argument
from kvexport.commands.interrupts import handle_errors
from kvexport.commands.params import WritablePath
from kvexport.options import INIT_SEED


@click.command("show-config")
@config_argument
@handle_errors
def show_config(config: Path) -> None:
    """Check CONFIG and print it with every default filled in."""
    import yaml

    from kvexport.config import load_config

    click.echo(yaml.safe_dump(load_config(config).to_dict(), sort_keys=False), nl=False)


@click.command("init-checkpoint")
@config_argument
@click.option("-o", "--output", type=WritablePath(), required=True, help="Checkpoint file to write.")
@click.option("--seed", type=int, default=INIT_SEED, show_default=True, help="Seed of the random initialisation.")
@handle_errors
def init_checkpoint(config: Path, output: Path, seed: int) -> None:
    """Write a randomly initialised checkpoint (a state_dict) for CONFIG."""
    from kvexport.config import load_config
    from kvexport.model import build_model
    from kvexport.model.checkpoint import save_checkpoint

    model = build_model(load_config(config), seed=seed)
    save_checkpoint(model, output)
    click.echo(f"wrote {output} ({sum(p.numel() for p in model.parameters())} parameters)")
