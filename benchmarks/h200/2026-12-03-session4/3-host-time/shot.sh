#!/usr/bin/env bash
# One short H200 run: the host-time changes, built and measured on kuairand-1k.
out=$1
set -o pipefail
cd "$(dirname "$0")"
t() { local s=$(date +%s); "$@"; local rc=$?; echo "$* -> rc $rc in $(( $(date +%s) - s )) s" >> "$out/summary.txt"; return $rc; }
t python3 -m kvexport.native > "$out/native.log" 2>&1 || exit 1
t python3 - > "$out/batch-to.log" 2>&1 <<'PY'
import torch
from kvexport.model.batch import Batch
b = Batch(torch.arange(3), torch.tensor([2, 0, 5]), torch.arange(7) * 3, torch.arange(7) % 4,
          torch.arange(12).view(3, 4), torch.tensor([1, 2, 1]), torch.arange(4) + 9)
moved = b.to("cuda")
for name, a, m in zip("abcdefg", b.tensors(), moved.tensors()):
    assert m.is_cuda and m.shape == a.shape and torch.equal(m.cpu(), a), name
    assert m.data_ptr() % 128 == 0, name
print("Batch.to: equal, on cuda, 128-byte aligned")
PY
t python3 -m kvexport build configs/hstu-kuairand-1k.yaml -o /tmp/g3/kuairand --device cuda --force > "$out/build-kuairand.log" 2>&1 || exit 1
t python3 -m kvexport verify /tmp/g3/kuairand --json "$out/verify-kuairand.json" > "$out/verify-kuairand.log" 2>&1
t python3 benchmarks/h200/request_bench.py /tmp/g3/kuairand --trace-dir "$out/traces" --json "$out/request-bench-kuairand.json" > "$out/request-bench-kuairand.log" 2>&1
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null
