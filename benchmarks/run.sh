#!/usr/bin/env bash
# Measures the 2-core CPU table's bench and soak rows of benchmarks/RESULTS.md on this machine: the
# bench on configs/hstu-bench.yaml (its first run also builds the two portable op libraries whose
# attention kernel it compares with the native one), then the long soak of hstu-tiny. The reports go
# to OUT (default artifacts/bench-cpu, ignored by git); a run worth keeping is copied into
# benchmarks/results/<machine>/<date>-<commit>/ with a README.
#   benchmarks/run.sh [OUT]
set -euo pipefail
out=$(realpath -m "${1:-artifacts/bench-cpu}")
cd "$(dirname "$0")/.."
mkdir -p "$out"
kvexport=.venv/bin/kvexport
"$kvexport" bench configs/hstu-bench.yaml --json "$out/results-2core.json" --plot "$out/latency-vs-history.png"
"$kvexport" build configs/hstu-tiny.yaml -o artifacts/hstu-tiny --force
"$kvexport" soak artifacts/hstu-tiny --requests 2000 --users 100 --seed 7 --json "$out/soak-2000.json"
