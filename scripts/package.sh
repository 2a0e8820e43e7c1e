#!/usr/bin/env bash
# The CI packaging job: build -> verify (Python) -> replay (C++). Non-zero on any failure.
# JSON reports are kept in OUT/reports/.
#   scripts/package.sh CONFIG OUT [KVEXPORT]
set -euo pipefail
if [[ $# -lt 2 || $# -gt 3 ]]; then
  echo "usage: scripts/package.sh CONFIG OUT [KVEXPORT]" >&2
  exit 2
fi
config=$1
out=$2
kvexport=${3:-$(dirname "$0")/../.venv/bin/kvexport}

"$kvexport" build "$config" -o "$out" --force
mkdir -p "$out/reports"
"$kvexport" verify "$out" --json "$out/reports/verify.json"
"$kvexport" replay "$out" --json "$out/reports/replay.json"
echo "packaged $out: verify and replay passed (reports in $out/reports/)"
