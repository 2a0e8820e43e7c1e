"""A sample Meta DLRMv3 checkpoint for the README's import example:

    python -m tests.meta_sample OUT

writes OUT/save/<batch>/ (tests/helpers/meta_fixture.py's DlrmHSTU at IMPORTABLE_SIZES, sparse/ from two
gloo ranks) and OUT/items.txt, the item ids a deployment serves (every other row of the table).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.meta_fixture import IMPORTABLE_SIZES, TABLE_ROWS, write_checkpoint
from tests.helpers.network import free_port


def write_sample(out: Path, world: int = 2) -> None:
    write_checkpoint(out / "save", world, free_port(), sizes=IMPORTABLE_SIZES)
    (out / "items.txt").write_text("".join(f"{i}\n" for i in range(0, TABLE_ROWS["video_id"], 2)))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.meta_sample OUT")
    write_sample(Path(sys.argv[1]))
    print(f"wrote {sys.argv[1]}/save (a DLRMv3 checkpoint, 2 ranks) and {sys.argv[1]}/items.txt")
