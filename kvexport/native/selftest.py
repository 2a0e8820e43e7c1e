"""Build-time self-tests, each in a fresh interpreter: a refused request must come back to the host
whole, through the op library (here) and through a built package (kvexport.export.selftest, run by
the same launcher), and the process must go on serving.

A toolchain fault (a second C++ runtime, docs/design.md *The C++ runtime*) shows only when a C++
exception crosses a library boundary, and then it may kill the process: so the checks run in a
child, and the builder turns a child killed by a signal into one line naming the compiler.

    python -m kvexport.native.selftest LIB.so
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from kvexport.errors import UserError

_TIMEOUT_S = 600


class SelfTestError(UserError):
    """A freshly built library or package mishandled a refused request."""


def run_self_test(module: str, target: Path, compiler: str) -> None:
    """Runs the self-test `python -m MODULE TARGET` in a fresh interpreter; SelfTestError on any failure.

    MODULE: this one (an op library) or kvexport.export.selftest (a built package)."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", module, str(target)], capture_output=True, text=True, timeout=_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise SelfTestError(f"self-test of {target} did not finish in {_TIMEOUT_S} s") from None
    if result.returncode == 0:
        return
    if result.returncode < 0:
        raise SelfTestError(
            f"self-test of {target}: a refused request killed a fresh process "
            f"({signal.Signals(-result.returncode).name}); it was compiled by {compiler}, whose C++ "
            "runtime does not work beside torch's: build with a g++ that links libstdc++.so.6 "
            "dynamically (set CXX to it)"
        )
    lines = result.stderr.strip().splitlines()
    raise SelfTestError(f"self-test of {target}: {lines[-1] if lines else f'exit {result.returncode}'}")


def fail(message: str) -> None:
    """Ends the child with `message` as its last line of stderr (what run_self_test reports)."""
    raise SystemExit(message)


def check_op_library(path: Path) -> None:
    """The CPU attention kernel refuses a cache that does not fit q; its message must arrive whole
    (a second C++ runtime has been seen to cut it at the first formatted integer)."""
    import torch

    torch.ops.load_library(str(path))
    q = torch.zeros(2, 2, 4)  # [N, H, dh]
    cache = torch.zeros(3, 2, 4, 3, 4)  # [pages, 2, page_size, H=3 (not 2), dh]
    rows = torch.zeros(2, dtype=torch.long)
    expected = f"paged_attention: cache {list(cache.shape)} does not fit q {list(q.shape)}"
    try:
        torch.ops.kvexport.hstu_paged_attention(
            q, q, q, cache, torch.zeros(1, 1, dtype=torch.long), rows, rows, rows, 1.0, 1.0
        )
    except RuntimeError as exc:
        if expected not in str(exc):
            fail(f"the op library's refusal came back garbled: {str(exc).splitlines()[0]!r}, expected {expected!r}")
        return
    fail("the op library accepted a cache that does not fit q")


def main(argv: list[str], check) -> None:
    """A self-test child's entry: `check(Path(argv[0]))`, ending the process with its message on failure."""
    if len(argv) != 1:
        fail(f"a self-test takes one path, got {len(argv)} arguments")
    check(Path(argv[0]))


if __name__ == "__main__":
    main(sys.argv[1:], check_op_library)
