"""The shell blocks of README.md and docs/*.md, run as written, and the pages' shape.

Every ```sh block carries a marker on the line above it, saying which test runs it as written
(`<!-- example: tests/test_x.py runs this block ... -->`) or why none does (`<!-- example: not run
(REASON) -->`: a GPU, a server that runs until stopped, this suite itself). This module runs the
blocks that name it, with `.venv/bin/` read as this interpreter's directory, `artifacts/hstu-tiny`
as the session's tiny package and `/tmp/NAME` as a temporary directory; where a ```text block
marked `<!-- output of the block above ... -->` follows, the output must match it but for numbers
(times, errors and counts of another build's weights)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell", "console"}
MARKER = re.compile(
    r"<!-- example: (?:(?P<test>tests/test_\w+\.py) runs this block|not run \((?P<reason>.+)\))"
    r"[^>]*-->"
)
OUTPUT_MARKER = "<!-- output of the block above"
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
MAX_LINE = 200
MAX_README_LINES = 150


class Block(NamedTuple):
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    marker: str  # the line above the fence
    code: str
    output: str | None  # the expected output block that follows, if any

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(page: Path) -> list[tuple[int, str, str, str]]:
    """(line of the opening fence, its language, the line above it, the block's text) of each fenced block."""
    lines = page.read_text().splitlines()
    blocks, start, language = [], None, ""
    for number, line in enumerate(lines):
        if line.startswith("```"):
            if start is None:
                start, language = number, line[3:].strip()
            else:
                above = lines[start - 1] if start > 0 else ""
                blocks.append((start + 1, language, above, "\n".join(lines[start + 1 : number]) + "\n"))
                start = None
    return blocks


def shell_blocks() -> list[Block]:
    found = []
    for page in PAGES:
        blocks = fenced_blocks(page)
        for index, (line, language, above, code) in enumerate(blocks):
            if language not in SHELL:
                continue
            following = blocks[index + 1] if index + 1 < len(blocks) else None
            output = following[3] if following and following[2].startswith(OUTPUT_MARKER) else None
            found.append(Block(str(page.relative_to(ROOT)), line, above, code, output))
    return found


BLOCKS = shell_blocks()


def normalised(text: str) -> list[str]:
    return [" ".join(NUMBER.sub("#", line).split()) for line in text.strip().splitlines()]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.id)
def test_every_shell_block_names_the_test_that_runs_it_or_why_none_does(block):
    marker = MARKER.fullmatch(block.marker.strip())
    assert marker, (
        f"{block.id}: the line above the block must be <!-- example: tests/test_x.py runs this block -->"
        " or <!-- example: not run (REASON) -->"
    )
    test = marker["test"]
    if test:
        assert (ROOT / test).is_file(), f"{block.id}: {test} does not exist"
        if test != "tests/test_docs.py":
            assert block.page in (ROOT / test).read_text(), f"{block.id}: {test} never reads {block.page}"


def test_pages_stay_readable():
    """The README is a front door, not the manual; no line of any page runs past the screen."""
    long_lines = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if len(line) > MAX_LINE
    ]
    assert long_lines == [], f"lines over {MAX_LINE} characters"
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES


def _as_written_here(code: str, tmp_path: Path, artifact: Path) -> str:
    code = re.sub(r"/tmp/([\w.-]+)", lambda match: str(tmp_path / match[1]), code)
    code = code.replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    return code.replace("artifacts/hstu-tiny", str(artifact))


RUN_HERE = [
    block
    for block in BLOCKS
    if MARKER.fullmatch(block.marker.strip())
    and MARKER.fullmatch(block.marker.strip())["test"] in (None, "tests/test_docs.py")
]


@pytest.mark.parametrize("block", RUN_HERE, ids=lambda block: block.id)
def test_shell_block_runs_as_written(block, request, tmp_path):
    reason = MARKER.fullmatch(block.marker.strip())["reason"]
    if reason:
        pytest.skip(f"{block.id}: {reason}")
    artifact = request.getfixturevalue("tiny_artifact") if "artifacts/hstu-tiny" in block.code else ROOT / "artifacts"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _as_written_here(block.code, tmp_path, artifact)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if block.output is not None:  # as a terminal shows it: progress (stderr) first, then the report
        assert normalised(done.stderr) + normalised(done.stdout) == normalised(block.output), done.stderr + done.stdout
