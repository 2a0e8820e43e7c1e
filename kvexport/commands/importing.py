"""`kvexport import-checkpoint`: a trainer's checkpoint as a kvexport checkpoint and config
(kvexport.importers does the work)."""

from __future__ import annotations

from pathlib import Path

import click

from kvexport.commands.interrupts import handle_errors
from kvexport.commands.params import IdsFile, TableRows, WritablePath
from kvexport.options import ITEM_TABLE, MetaOptions, NvidiaOptions

# import-checkpoint's options that only one trainer reads, and those it needs.
TRAINER_FLAGS = {
    "nvidia": ("--trainer-config", "--table-rows", "--action-table", "--no-contextual-features", "--iteration"),
    "meta": (
        "--num-heads",
        "--max-history-length",
        "--max-candidates",
        "--items",
        "--batch",
        "--context-ids",
        "--history-positions",
        "--history-time",
    ),
}
REQUIRED_FLAGS = {"nvidia": ("--trainer-config",), "meta": ("--num-heads", "--max-history-length", "--max-candidates")}


def _check_trainer_flags(trainer: str, given: dict[str, object]) -> None:
    """UsageError for a trainer-specific option given with the other trainer, or a required one missing."""
    stray = [flag for flag, value in given.items() if value is not None and flag not in TRAINER_FLAGS[trainer]]
    if stray:
        raise click.UsageError(f"{stray[0]} does not apply to --from {trainer}")
    missing = [flag for flag in REQUIRED_FLAGS[trainer] if given[flag] is None]
    if missing:
        raise click.UsageError(f"--from {trainer} needs {missing[0]}")


def _given(**values) -> dict[str, object]:
    """The options given on the command line: those left out take the options class's default."""
    return {name: value for name, value in values.items() if value is not None}


@click.command("import-checkpoint")
@click.argument("source", type=click.Path(path_type=Path))
@click.option(
    "--from",
    "trainer",
    type=click.Choice(["nvidia", "meta"]),
    required=True,
    help="The trainer that wrote SOURCE: NVIDIA recsys-examples (examples/hstu ranking) or Meta "
    "generative-recommenders (DLRMv3 DlrmHSTU).",
)
@click.option("-o", "--output", type=WritablePath(), required=True, help="kvexport checkpoint to write.")
@click.option(
    "--config-out", type=WritablePath(), help="kvexport config to write (default: OUTPUT with the suffix .yaml)."
)
@click.option(
    "--trainer-config",
    type=click.Path(path_type=Path),
    help="nvidia: the trainer's gin file (NetworkArgs, DatasetArgs, RankingArgs bindings); required.",
)
@click.option(
    "--table-rows",
    type=TableRows(),
    multiple=True,
    help="nvidia: rows of a data-parallel table (repeatable); the checkpoint does not hold them.",
)
@click.option("--item-table", default=ITEM_TABLE, show_default=True, help="The item feature's table.")
@click.option("--action-table", help=f"nvidia: the action feature's table (default: {NvidiaOptions.action_table}).")
@click.option(
    "--contextual-features",
    "contextual",
    metavar="NAME,...",
    default="",
    help="The contextual features' tables in token order (the trainer's preprocessor order).",
)
@click.option(
    "--no-contextual-features",
    "skip_contextual",
    is_flag=True,
    help="nvidia: leave the contextual features' tables out (recsys-examples' disable_contextual_features).",
)
@click.option("--iteration", type=click.IntRange(min=0), help="nvidia: which iter<N> of SOURCE (default: the newest).")
@click.option("--num-heads", type=click.IntRange(min=1), help="meta: attention heads (hstu_num_heads); required.")
@click.option(
    "--max-history-length",
    type=click.IntRange(min=1),
    help="meta: the most history events a request carries; required.",
)
@click.option(
    "--max-candidates", type=click.IntRange(min=1), help="meta: the most candidates a request carries; required."
)
@click.option(
    "--items",
    "items_file",
    type=click.Path(path_type=Path),
    help="meta: a text file of the item ids served, one per line; only their rows are read "
    "(default: the whole item table, ids as rows).",
)
@click.option(
    "--batch",
    "batch_index",
    type=click.IntRange(min=0),
    help="meta: which <batch> directory of SOURCE (default: the newest).",
)
@click.option(
    "--context-ids",
    "context_ids",
    type=IdsFile(),
    multiple=True,
    help="meta: FEATURE=FILE, a text file of the ids of contextual feature FEATURE served, one per "
    "line (repeatable); only their rows are read (default: the feature's whole table).",
)
@click.option(
    "--history-positions",
    type=click.Choice(["from_max", "from_start"]),
    help="meta: where history events sit in DlrmHSTU's position table, which counts back from the "
    "newest event (no cache can follow that): counted back from --max-history-length events "
    "(the default) or from the oldest event (docs/checkpoint.md).",
)
@click.option(
    "--history-time",
    type=click.Choice(["zero", "none"]),
    help="meta: the time row history events read in place of their age's bucket, which no cache can "
    "follow: row 0, an event that just happened (the default), or none (docs/checkpoint.md).",
)
@click.option("--name", help="The model's name in the config (default: the output's stem).")
@handle_errors
def import_checkpoint(
    source: Path,
    trainer: str,
    output: Path,
    config_out: Path | None,
    trainer_config: Path | None,
    table_rows: tuple[tuple[str, int], ...],
    item_table: str,
    action_table: str | None,
    contextual: str,
    skip_contextual: bool,
    iteration: int | None,
    num_heads: int | None,
    max_history_length: int | None,
    max_candidates: int | None,
    items_file: Path | None,
    batch_index: int | None,
    context_ids: tuple[tuple[str, Path], ...],
    history_positions: str | None,
    history_time: str | None,
    name: str | None,
) -> None:
    """Import a trainer's checkpoint directory SOURCE as a kvexport checkpoint and config.

    Every tensor is mapped by name and shape and checked; what the checkpoint lacks comes from
    the options (and, for nvidia, --trainer-config). Anything that cannot be mapped is refused in
    one line (exit 2) and nothing is written. docs/checkpoint.md, *Importing*, says what is
    supported, and for meta which of DlrmHSTU's rules are replaced by per-user ones.
    """
    from kvexport.importers.checkpoint import import_checkpoint as run_import
    from kvexport.importers.meta_dlrmv3 import check_context_ids, read_ids

    config_out = config_out or output.with_suffix(".yaml")
    features = tuple(f.strip() for f in contextual.split(",") if f.strip())
    given = {
        "--trainer-config": trainer_config,
        "--table-rows": table_rows or None,
        "--action-table": action_table,
        "--no-contextual-features": skip_contextual or None,
        "--iteration": iteration,
        "--num-heads": num_heads,
        "--max-history-length": max_history_length,
        "--max-candidates": max_candidates,
        "--items": items_file,
        "--batch": batch_index,
        "--context-ids": context_ids or None,
        "--history-positions": history_positions,
        "--history-time": history_time,
    }
    _check_trainer_flags(trainer, given)
    if trainer == "nvidia":
        options = NvidiaOptions(
            item_table=item_table,
            table_rows=dict(table_rows),
            contextual_features=features,
            skip_contextual=skip_contextual,
            iteration=iteration,
            **_given(action_table=action_table),
        )
    else:
        check_context_ids((feature for feature, _ in context_ids), features)  # before any file is read
        options = MetaOptions(
            num_heads=num_heads,
            max_history_length=max_history_length,
            max_num_candidates=max_candidates,
            item_table=item_table,
            contextual_features=features,
            items=None if items_file is None else read_ids(items_file),
            batch=batch_index,
            context_ids={feature: read_ids(path) for feature, path in context_ids},
            **_given(history_time=history_time, history_positions=history_positions),
        )
    imported = run_import(trainer, source, options, output, config_out, name or output.stem, trainer_config)
    for note in imported.notes:
        click.echo(note)
    click.echo(
        f"wrote {output} and {config_out} ({trainer}; {sum(t.numel() for t in imported.state_dict.values())} values)"
    )
