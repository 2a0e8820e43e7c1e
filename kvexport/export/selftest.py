"""The built package's self-test, run by kvexport.native.selftest's launcher in a fresh interpreter
after every build (a refused request must come back whole and the process go on serving):

    python -m kvexport.export.selftest ARTIFACT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvexport.native.selftest import fail, main


def check_package(root: Path) -> None:
    """Through the package itself (not the Python-side check): a request with a negative item id
    (outside the vocabulary whether ids are rows or keys) is refused with the runtime's code and
    whole message, then the trace's first request scores as recorded."""
    import torch

    from kvexport.artifact import TRACE_KEYS
    from kvexport.errors import RequestFailed
    from kvexport.host.package import load
    from kvexport.model.batch import Batch
    from kvexport.trace.record import load_trace_step
    from kvexport.trace.verify import compare

    with load(root, check_files=False, step_program=False) as package:  # model.pt2, as plain hosts run it
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
                fail(f"the package refused with {exc.code}: {str(exc)!r}; expected invalid_request: {message!r}")
        else:
            fail("the package accepted a negative item id")
        output = package.score(request)
        atol, rtol = package.artifact.tolerance["atol"], package.artifact.tolerance["rtol"]
        if not compare(output.cpu(), expected.to(torch.float32), atol, rtol).passed:
            fail("after a refused request the package's next output differs from the recorded one")


if __name__ == "__main__":
    main(sys.argv[1:], check_package)
