"""Build-time self-tests, each in a fresh interpreter: a refused request must come back to the host
whole, through the op library and through a built package, and the process must go on serving.

A toolchain fault (a second C++ runtime, docs/design.md *The C++ runtime*) shows only when a C++
exception crosses a library boundary, and then it may kill the process: so the checks run in a
child, and the builder turns a child killed by a signal into one line naming the compiler.

    python -m kvexport.selftest op-library LIB.so
    python -m kvexport.selftest package ARTIFACT_DIR
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


def run_self_test(kind: str, target: Path, compiler: str) -> None:
    """Runs `kind`'s self-test on `target` in a fresh interpreter; SelfTestError on any failure."""
    try:
        result = subprocess.run([sys.executable, "-m", "kvexport.selftest", kind, str(target)],
                                capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SelfTestError(f"self-test of {target} did not finish in {_TIMEOUT_S} s") from None
    if result.returncode == 0:
        return
    if result.returncode < 0:
        raise SelfTestError(f"self-test of {target}: a refused request killed a fresh process "
                            f"({signal.Signals(-result.returncode).name}); it was compiled by {compiler}, whose C++ "
                            "runtime does not work beside torch's: build with a g++ that links libstdc++.so.6 "
                            "dynamically (set CXX to it)")
    lines = result.stderr.strip().splitlines()
    raise SelfTestError(f"self-test of {target}: {lines[-1] if lines else f'exit {result.returncode}'}")


def _fail(message: str) -> None:
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
        torch.ops.kvexport.hstu_paged_attention(q, q, q, cache, torch.zeros(1, 1, dtype=torch.long), rows, rows,
                                                rows, 1.0, 1.0)
    except RuntimeError as exc:
        if expected not in str(exc):
            _fail(f"the op library's refusal came back garbled: {str(exc).splitlines()[0]!r}, expected {expected!r}")
        return
    _fail("the op library accepted a cache that does not fit q")


def check_package(root: Path) -> None:
    """Through the package itself (not the Python-side check): a request with a negative item id
    (outside the vocabulary whether ids are rows or keys) is refused with the runtime's code and
    whole message, then the trace's first request scores as recorded."""
    import torch

    import kvexport
    from kvexport.artifact import TRACE_KEYS
    from kvexport.errors import RequestFailed
    from kvexport.model.batch import Batch
    from kvexport.runner import load_trace_step
    from kvexport.trace.verify import compare

    with kvexport.load(root, check_files=False, step_program=False) as package:  # model.pt2, as plain hosts run it
        step = next(s for s in package.artifact.trace_steps if not s.get(TRACE_KEYS["expect_error"]))
        request, expected, _ = load_trace_step(root / step[TRACE_KEYS["file"]])
        limit = package.config.model.item_id_limit  # the table's rows, or any key >= 0
        bad = {**request, "item_ids": request["item_ids"].clone()}
        bad["item_ids"][0] = -1
        message = f"item_ids has -1, outside the item vocabulary [0, {limit - 1}]"
        try:
            package.run(Batch(**bad))
        except RequestFailed as exc:
            if exc.code != "invalid_request" or not str(exc).endswith(message):
                _fail(f"the package refused with {exc.code}: {str(exc)!r}; expected invalid_request: {message!r}")
        else:
            _fail("the package accepted a negative item id")
        output = package.score(request)
        atol, rtol = package.artifact.tolerance["atol"], package.artifact.tolerance["rtol"]
        if not compare(output.cpu(), expected.to(torch.float32), atol, rtol).passed:
            _fail("after a refused request the package's next output differs from the recorded one")


def _main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("op-library", "package"):
        _fail("usage: python -m kvexport.selftest op-library LIB.so | package ARTIFACT_DIR")
    kind, target = argv[0], Path(argv[1])
    (check_op_library if kind == "op-library" else check_package)(target)


if __name__ == "__main__":
    _main(sys.argv[1:])
