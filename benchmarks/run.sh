#!/usr/bin/env bash
# Reproduces benchmarks/RESULTS.md on this machine (about 10 minutes on 2 cores, more the first time:
# the bench builds two portable op libraries to compare their attention kernel with the native one).
set -euo pipefail
cd "$(dirname "$0")/.."
kvexport=.venv/bin/kvexport
"$kvexport" bench configs/hstu-bench.yaml --json benchmarks/results-2core.json --plot benchmarks/latency-vs-history.png
"$kvexport" build configs/hstu-tiny.yaml -o artifacts/hstu-tiny --force
"$kvexport" soak artifacts/hstu-tiny --requests 2000 --users 100 --seed 7 --json benchmarks/soak-2000.json
