#!/usr/bin/env bash
# One command for a GPU host: builds the native code with its CUDA kernels, runs the CUDA tests,
# times the attention kernel (alone and beside torch's fused attention), then builds, verifies,
# replays (model.pt2, and step.pt2 as CUDA graphs) and soaks the tiny and the kuairand-1k configs
# on the GPU and benchmarks them; serves the tiny one through Triton when the serve extra is
# installed. Every step runs even if an earlier one failed (unless it needs that one's artifact);
# each writes OUT/STEP.log, the JSON reports go to
# OUT/, packages to OUT/artifacts/, and OUT/summary.txt says how each step ended.
#   scripts/gpu-check.sh [OUT] [PYTHON] [--quick] [--resume]
# OUT: default artifacts/gpu-check (ignored by git). It may not be elsewhere in the source tree: what
#   a run leaves is no source; the JSON reports of a run worth keeping are copied into
#   benchmarks/results/<machine>/<date>-<commit>/ with a README (benchmarks/RESULTS.md).
# PYTHON: the interpreter that has torch with CUDA and kvexport importable (default python3).
# A relative OUT or PYTHON is taken from the checkout's root, where every step runs.
# --quick: the tiny config only (no kuairand-1k build, which takes minutes).
# --resume: after a run of the same sources into the same OUT, keep the steps its summary.txt
#   records as passed and run the others. A config's steps all run again when its package is
#   rebuilt (its build had not passed, or its package is gone from OUT/artifacts/); the native
#   build always runs (it is quick when up to date); after any change to the sources every step
#   runs.
# Exit 0 when every step passed, 1 otherwise, 2 on bad usage.
set -uo pipefail
usage="usage: scripts/gpu-check.sh [OUT] [PYTHON] [--quick] [--resume]"
positional=()
quick=0
resume=0
for arg in "$@"; do
  case $arg in
    --quick) quick=1 ;;
    --resume) resume=1 ;;
    -*) echo "gpu-check: unknown option $arg; $usage" >&2; exit 2 ;;
    *) positional+=("$arg") ;;
  esac
done
if [[ ${#positional[@]} -gt 2 ]]; then
  echo "$usage" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
root=$(pwd -P)
out=$(realpath -m "${positional[0]:-artifacts/gpu-check}")
python=${positional[1]:-python3}
case $out/ in
  "$root"/artifacts/*) ;;
  "$root"/*)
    echo "gpu-check: OUT $out is inside the source tree: name a directory outside it, or under artifacts/" >&2
    exit 2 ;;
esac
# The benchmark scripts import kvexport from outside the checkout's root: it must be installed
# (-P: without the current directory on the module path).
if ! "$python" -P -c 'import kvexport' > /dev/null 2>&1; then
  echo "gpu-check: $python cannot import kvexport outside this checkout: install it first" \
    "($python -m pip install --no-deps -e .)" >&2
  exit 2
fi
mkdir -p "$out/artifacts"
# The sources a run tests, as one hash: --resume keeps nothing from a run of other sources. What
# the native step builds into kvexport/_lib is no source (else no run could resume its own).
sources=$( { find csrc kvexport configs scripts tests pyproject.toml -type f ! -path '*/__pycache__/*' \
    ! -path 'kvexport/_lib/*' -print0
  find benchmarks -name '*.py' -print0; } 2> /dev/null | LC_ALL=C sort -z | xargs -0 -r sha256sum | sha256sum |
  cut -c1-64)
previous=""
if [[ $resume == 1 && -f $out/summary.txt ]]; then
  if [[ $(cat "$out/sources.sha256" 2> /dev/null) == "$sources" ]]; then
    previous=$(< "$out/summary.txt")
  else
    echo "gpu-check: the sources changed since the run in $out: every step runs again" >&2
  fi
fi
echo "$sources" > "$out/sources.sha256"
: > "$out/summary.txt"
failed=0
rebuilt=""  # configs whose package this run builds: none of their earlier passes are kept

# kept NAME: whether --resume keeps step NAME's earlier pass.
kept() {
  local name=$1 config
  [[ $name != native ]] && grep -q "^$name: passed" <<< "$previous" || return 1
  if [[ $name == build-* ]]; then
    [[ -f $out/artifacts/${name#build-}/manifest.json ]] || return 1
  fi
  for config in $rebuilt; do
    case $name in
      verify-$config | replay-$config | replay-graphs-$config | soak-$config | request-bench-$config | \
        host-phases-$config | bench-$config | weights-bench-$config | serve-$config) return 1 ;;
    esac
  done
  return 0
}

# step NAME COMMAND...: runs COMMAND with its output in OUT/NAME.log and records how it ended.
step() {
  local name=$1 started status
  shift
  if kept "$name"; then
    echo "$name: passed in an earlier run (kept by --resume)" | tee -a "$out/summary.txt"
    return 0
  fi
  [[ $name == build-* ]] && rebuilt+=" ${name#build-}"
  started=$(date +%s)
  echo "[$(date +%H:%M:%S)] $name: $*"
  if "$@" > "$out/$name.log" 2>&1; then
    status=passed
  else
    status="FAILED (exit $?; see $name.log)"
    failed=1
  fi
  echo "$name: $status in $(( $(date +%s) - started )) s" | tee -a "$out/summary.txt"
  [[ $status == passed ]]
}

kvexport() { "$python" -m kvexport "$@"; }

# package NAME CONFIG SOAK_REQUESTS SOAK_USERS: build, verify, replay and soak one config on the GPU,
# with enough users that the soak's working set overflows the device tier (evictions, offloads and
# onboards; kuairand-1k's 16,384 device pages hold about 330 of its soak users, and its 250
# requests of 1 to 32 users each step every one of 400 users some ten times).
package() {
  local name=$1 config=$2 requests=$3 users=$4 artifact="$out/artifacts/$1"
  step "build-$name" kvexport build "$config" -o "$artifact" --device cuda --force || return
  step "verify-$name" kvexport verify "$artifact" --json "$out/verify-$name.json"
  step "replay-$name" kvexport replay "$artifact" --json "$out/replay-$name.json"
  # The C++ harness planning each request itself and replaying step.pt2 as CUDA graphs.
  step "replay-graphs-$name" kvexport replay "$artifact" --route graphs --threads 2 \
    --json "$out/replay-graphs-$name.json"
  step "soak-$name" kvexport soak "$artifact" --requests "$requests" --users "$users" --json "$out/soak-$name.json"
}

step native "$python" -m kvexport.native || exit 1
# The environment as the run found it: no variable of it is changed here (LD_PRELOAD included).
"$python" - > "$out/environment.txt" 2>&1 <<'EOF'
import os, platform, torch
from kvexport.native import toolchain
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())
print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
print("CXX", os.environ.get("CXX", "(unset)"), "CC", os.environ.get("CC", "(unset)"))
print("LD_PRELOAD", os.environ.get("LD_PRELOAD", "(unset)"))
print("compiler kvexport builds with", toolchain.select_compiler().path)
EOF
# --durations: which tests take the step's minutes (the check's slowest step, six to seven of them).
step pytest-cuda "$python" -m pytest -m cuda -q -p no:cacheprovider --durations=15
step attention-bench "$python" benchmarks/gpu/attention_bench.py --json "$out/attention-bench.json"
# The same bytes through torch's own fused attention backends, side by side.
step peers "$python" benchmarks/gpu/peers.py --json "$out/peers.json"
# 1,024 candidates a user (1,088 query rows against 8,262 keys): the compute-bound shape.
step attention-bench-c1024 "$python" benchmarks/gpu/attention_bench.py --candidates 1024 --batch 1,8 \
  --json "$out/attention-bench-c1024.json"
step peers-c1024 "$python" benchmarks/gpu/peers.py --candidates 1024 --batch 1,8 --json "$out/peers-c1024.json"
if command -v ncu > /dev/null; then
  # Where the attention kernel's time goes at batch 8 (Nsight Compute: throughput, memory, occupancy, stalls).
  step profile-attention ncu --clock-control none -k regex:attention_ --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
    "$python" benchmarks/gpu/attention_bench.py --profile --batch 8 --warmup 2 --repeats 1
fi
package tiny configs/hstu-tiny.yaml 500 40
step request-bench-tiny "$python" benchmarks/gpu/request_bench.py "$out/artifacts/tiny" --length 96 \
  --new-events 8 --candidates 8 --batch 1,4 --json "$out/request-bench-tiny.json"
# The CUDA package behind Triton (`kvexport serve`, the serve extra's tritonserver), when installed.
if "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("pytriton") is None)'; then
  step serve-tiny "$python" benchmarks/gpu/serve_gpu.py "$out/artifacts/tiny" --json "$out/serve-tiny.json"
fi
if [[ $quick == 0 ]]; then
  package kuairand configs/hstu-kuairand-1k.yaml 250 400
  # The H200 workload: 32 new events, 100 candidates, batch 1, 8 and 32, and as many cached events
  # as the config's max_history_length (4096) leaves room for: 4064.
  step request-bench-kuairand "$python" benchmarks/gpu/request_bench.py "$out/artifacts/kuairand" \
    --trace-dir "$out/traces" --json "$out/request-bench-kuairand.json"
  # Where the host's time goes in a graphs request: each phase of the step route on its own.
  step host-phases-kuairand "$python" benchmarks/gpu/host_phases.py "$out/artifacts/kuairand" \
    --json "$out/host-phases-kuairand.json"
  step bench-kuairand kvexport bench "$out/artifacts/kuairand" --lengths 1024,4064 --repeats 3 \
    --json "$out/bench-kuairand.json"
  # Its 1 GB item table inside the package's .so (the package built above) or beside it (compiled
  # here): size, compile, load. Last: the slowest step, and the one a run short of device time can
  # best resume later.
  # The same model scoring 1,024 candidates a user, batch 1 and 8.
  if step build-kuairand-c1024 kvexport build configs/hstu-kuairand-1k-c1024.yaml \
      -o "$out/artifacts/kuairand-c1024" --device cuda --force; then
    step request-bench-kuairand-c1024 "$python" benchmarks/gpu/request_bench.py "$out/artifacts/kuairand-c1024" \
      --candidates 1024 --batch 1,8 --json "$out/request-bench-kuairand-c1024.json"
  fi
  step weights-bench-kuairand "$python" benchmarks/gpu/weights_bench.py configs/hstu-kuairand-1k.yaml \
    --device cuda --package "$out/artifacts/kuairand" --json "$out/weights-bench-kuairand.json"
fi
exit $failed
