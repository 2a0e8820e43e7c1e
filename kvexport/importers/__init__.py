"""Reading checkpoints as other trainers write them (docs/importers.md)."""
