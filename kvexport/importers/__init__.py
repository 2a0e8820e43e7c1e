"""Reading checkpoints as other trainers write them (docs/importers.md)."""

from kvexport.errors import UserError


class CheckpointImportError(UserError):
    """The trainer's checkpoint cannot be imported exactly; the message names what and why."""
