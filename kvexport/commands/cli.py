"""kvexport command line: the `kvexport` group, its global options and its commands.

Each command lives with its group in kvexport/commands/ (config, importing, build, verify, score,
serve, bench); it parses its arguments and calls library functions, nothing more. Commands import
their library modules when they run, so `kvexport --help` does not pay for torch.
"""

from __future__ import annotations

import logging
import sys
import warnings

import click

from kvexport import __version__
from kvexport.commands.bench import bench
from kvexport.commands.build import build, inspect
from kvexport.commands.config import init_checkpoint, show_config
from kvexport.commands.importing import import_checkpoint
from kvexport.commands.score import run, score
from kvexport.commands.serve import serve, triton_repo
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


# Grouped as the pipeline runs; `kvexport --help` lists them by name.
for command in (
    show_config,
    init_checkpoint,
    import_checkpoint,
    build,
    inspect,
    verify,
    replay,
    soak,
    run,
    score,
    serve,
    triton_repo,
    bench,
):
    main.add_command(command)
