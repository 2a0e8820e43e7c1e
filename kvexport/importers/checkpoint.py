"""`kvexport import-checkpoint`'s work: a trainer's checkpoint read by its importer, checked against
the model its config describes, and written as a kvexport checkpoint and config."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from kvexport.config import config_from_dict
from kvexport.importers import Imported
from kvexport.importers.meta_dlrmv3 import import_meta
from kvexport.importers.nvidia_ranking import import_nvidia
from kvexport.io import write_atomically
from kvexport.model.checkpoint import check_state_dict
from kvexport.model.hstu import HSTURanker
from kvexport.options import MetaOptions, NvidiaOptions


def import_checkpoint(
    trainer: str,
    source: Path,
    options: NvidiaOptions | MetaOptions,
    output: Path,
    config_out: Path,
    name: str,
    trainer_config: Path | None = None,
) -> Imported:
    """Imports `trainer`'s ("nvidia" or "meta") checkpoint directory `source` with its options
    (nvidia: NvidiaOptions and the trainer's gin file `trainer_config`; meta: MetaOptions).

    The config must load as written and every tensor fit the model it describes (checked on the meta
    device, without allocating tables) before anything is written; then the checkpoint, then the
    config, each atomically, and the checkpoint removed again if the config cannot be written.
    CheckpointImportError / UserError naming the problem otherwise, with nothing written.
    """
    if trainer == "nvidia":
        imported = import_nvidia(source, trainer_config, options, name)
    elif trainer == "meta":
        imported = import_meta(source, options, name)
    else:
        raise ValueError(f"unknown trainer {trainer!r}: expected nvidia or meta")
    config = config_from_dict(imported.config)
    with torch.device("meta"):
        check_state_dict(imported.state_dict, HSTURanker(config), output)
    write_atomically(output, lambda tmp: torch.save(imported.state_dict, tmp), "checkpoint")
    try:
        write_atomically(
            config_out, lambda tmp: tmp.write_text(yaml.safe_dump(imported.config, sort_keys=False)), "config"
        )
    except BaseException:
        output.unlink(missing_ok=True)
        raise
    return imported
