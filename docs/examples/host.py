"""A host of a kvexport package with torch alone: no kvexport import, no YAML, no env var.

    python host.py OUT        (OUT: an artifact directory written by `kvexport build`)

Scores the first request of OUT's trace, then a request with an id past the item vocabulary
(the package must refuse it), asks the runtime why, and scores the first request again.
See docs/hosting.md.
"""

import json
import sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
manifest = json.loads((out / "manifest.json").read_text())
torch.ops.load_library(str(out / "lib" / "libkvexport_ops.so"))  # before the package loader
if "fbgemm_gpu_py" in manifest["required_libraries"]:
    import fbgemm_gpu  # noqa: F401  (only a package built with fbgemm's jagged ops lists it)
package = torch._inductor.aoti_load_package(str(out / "model.pt2"))
metadata = package.get_metadata()
runtime, signature = metadata["kvexport.runtime_name"], json.loads(metadata["kvexport.signature"])

step = torch.load(out / manifest["trace"]["steps"][0]["file"], weights_only=True)  # a request + its logits
request, expected = [step[name] for name in signature], step["expected_full"]


def score(tag, inputs):
    logits = package(*inputs)
    error = (logits - expected).abs().max().item() if logits.shape == expected.shape else float("inf")
    print(f"{tag} shape {list(logits.shape)} max_abs_err {error:.3e}", flush=True)


score("good", request)
bad = [t.clone() for t in request]
bad[signature.index("candidate_ids")][0] = manifest["dims"]["item_vocab_size"]  # one past the vocabulary
try:
    package(*bad)
    print("bad accepted", flush=True)
except RuntimeError:  # one catchable error; the text is not parsed (it differs between torch versions)
    print("bad refused", flush=True)
code, message = torch.ops.kvexport.last_error(runtime)
print(f"last_error {code}: {message}", flush=True)
score("again", request)
