"""A host that knows nothing of kvexport: torch, the artifact's op library and model.pt2 only.

    python plain_host.py OUT CORPUS {sequential,threads}

CORPUS is a torch.save'd dict: "hostile" (a list of [request, expected message]) and "good"
(a list of [request, expected logits]). Run by tests.helpers.hostile.run_plain_host in a subprocess, so a
crash or a hang of the package shows as this process's exit status or timeout. Prints one JSON
summary line; exits 0 when every expectation held.
"""

import json
import sys
import threading
from pathlib import Path

import torch

SIGNATURE = ("user_ids", "history_lengths", "item_ids", "action_ids", "context_ids", "num_candidates", "candidate_ids")


def score(model, request):
    """The package's logits, on the CPU; the inputs stay on the host, whatever the package's device."""
    return model(*(request[name] for name in SIGNATURE)).cpu()


def refused_properly(model, runtime, request, message):
    """The request raises, and the runtime says why: code invalid_request, the expected message."""
    try:
        score(model, request)
    except Exception:  # noqa: BLE001 — a host catches whatever the package raises
        code, text = torch.ops.kvexport.last_error(runtime)
        return code == "invalid_request" and message in text, f"{code}: {text}"
    return False, "accepted"


def correct(model, request, expected, atol):
    try:
        output = score(model, request)
    except Exception as exc:  # noqa: BLE001
        return False, f"refused: {str(exc).splitlines()[0]}"
    error = (output - expected).abs().max().item()
    return error <= atol, f"max abs error {error:.3g}"


def sequential(model, runtime, corpus, atol):
    failures = []
    for i, (request, message) in enumerate(corpus["hostile"]):
        ok, detail = refused_properly(model, runtime, request, message)
        if not ok:
            failures.append(f"hostile {i} ({message}): {detail}")
        good, expected = corpus["good"][i % len(corpus["good"])]
        ok, detail = correct(model, good, expected, atol)
        if not ok:
            failures.append(f"good request after hostile {i}: {detail}")
    return failures


def threads(model, runtime, corpus, atol, num_threads=8, rounds=3):
    """Every thread alternates hostile and valid requests; valid users are disjoint per thread."""
    failures = []
    lock = threading.Lock()

    def worker(t):
        for r in range(rounds):
            for i, (request, message) in enumerate(corpus["hostile"]):
                if (i + t) % num_threads == r % num_threads or i % 3 == t % 3:
                    ok, detail = refused_properly(model, runtime, request, message)
                    if not ok:
                        with lock:
                            failures.append(f"thread {t} hostile {i}: {detail}")
                good, expected = corpus["good"][(t + i) % len(corpus["good"])]
                ok, detail = correct(model, good, expected, atol)
                if not ok:
                    with lock:
                        failures.append(f"thread {t} good: {detail}")

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return failures


def main():
    out, corpus_path, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.ops.load_library(str(out / "lib" / "libkvexport_ops.so"))
    model = torch._inductor.aoti_load_package(str(out / "model.pt2"))
    runtime = model.get_metadata()["kvexport.runtime_name"]
    atol = float(json.loads((out / "manifest.json").read_text())["tolerance"]["atol"])
    corpus = torch.load(corpus_path, weights_only=True)
    run = sequential if mode == "sequential" else threads
    failures = run(model, runtime, corpus, atol)
    print(json.dumps({"failures": failures, "hostile": len(corpus["hostile"]), "good": len(corpus["good"])}))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
