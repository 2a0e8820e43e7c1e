"""scripts/gpu-check.sh's bookkeeping, with a stand-in interpreter (no GPU needed) and a copy of the
script in a tree of its own: every step runs and is recorded, a failed step does not stop the
others, and --resume runs again only what had not passed — and everything of a config whose
package it has to rebuild, and everything after a change to the sources."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "gpu-check.sh"

# Stands in for PYTHON: succeeds, except for a command line containing a line of fail.txt (beside
# it); `-m kvexport build ... -o DIR` leaves a package's manifest in DIR, as a build does.
STAND_IN = """#!/usr/bin/env bash
here=$(dirname "$0")
if [[ $1 == - ]]; then cat > /dev/null; exit 0; fi
while read -r pattern; do
  if [[ -n $pattern && "$*" == *"$pattern"* ]]; then exit 3; fi
done < "$here/fail.txt"
if [[ $1 == -m && $2 == kvexport && $3 == build ]]; then
  previous=""
  for arg in "$@"; do
    if [[ $previous == -o ]]; then mkdir -p "$arg" && echo '{}' > "$arg/manifest.json"; fi
    previous=$arg
  done
fi
exit 0
"""

TINY_STEPS = {
    "build-tiny",
    "verify-tiny",
    "replay-tiny",
    "replay-graphs-tiny",
    "soak-tiny",
    "request-bench-tiny",
    "serve-tiny",
}


@pytest.fixture
def script(tmp_path) -> Path:
    """The script in a source tree of its own (one source file besides it), so that a test can
    change the sources."""
    copy = tmp_path / "tree" / "scripts" / "gpu-check.sh"
    copy.parent.mkdir(parents=True)
    shutil.copy(SCRIPT, copy)
    (tmp_path / "tree" / "kvexport").mkdir()
    (tmp_path / "tree" / "kvexport" / "model.py").write_text("version = 1\n")
    return copy


@pytest.fixture
def stand_in(tmp_path) -> Path:
    interpreter = tmp_path / "python"
    interpreter.write_text(STAND_IN)
    interpreter.chmod(interpreter.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "fail.txt").write_text("")
    return interpreter


def gpu_check(
    script: Path, out: Path, interpreter: Path, *options: str, failing: str = ""
) -> tuple[int, dict[str, str]]:
    """Runs the script; returns its exit code and each step's outcome: 'ran' (passed this time),
    'kept' (kept by --resume) or 'failed'."""
    (interpreter.parent / "fail.txt").write_text(failing + "\n")
    result = subprocess.run(
        ["bash", str(script), str(out), str(interpreter), *options], capture_output=True, text=True, timeout=120
    )
    outcomes = {}
    for line in (out / "summary.txt").read_text().splitlines():
        name, how = line.split(": ", 1)
        outcomes[name] = "kept" if "kept by --resume" in how else "failed" if how.startswith("FAILED") else "ran"
    return result.returncode, outcomes


def ran(outcomes: dict[str, str]) -> set[str]:
    return {name for name, how in outcomes.items() if how == "ran"}


def test_a_failed_step_does_not_stop_the_others_and_resume_runs_only_what_had_not_passed(tmp_path, script, stand_in):
    out = tmp_path / "out"
    code, first = gpu_check(script, out, stand_in, "--quick", failing="soak")
    assert code == 1
    assert first["soak-tiny"] == "failed" and first["request-bench-tiny"] == "ran"
    kernel_steps = {"native", "pytest-cuda", "attention-bench", "peers", "attention-bench-c1024", "peers-c1024"}
    assert set(first) == kernel_steps | TINY_STEPS | ({"profile-attention"} if "profile-attention" in first else set())

    code, second = gpu_check(script, out, stand_in, "--quick", "--resume")
    assert code == 0
    assert set(second) == set(first)
    assert ran(second) == {"native", "soak-tiny"}

    code, third = gpu_check(script, out, stand_in, "--quick", "--resume")
    assert code == 0 and ran(third) == {"native"}


@pytest.mark.parametrize(
    "config, among", [("tiny", TINY_STEPS), ("kuairand", {"build-kuairand", "weights-bench-kuairand"})]
)
def test_resume_runs_every_step_of_a_config_whose_package_is_gone(tmp_path, script, stand_in, config, among):
    """Every step of that config runs again, the weights benchmark among kuairand's (it times the
    package as built); the other config's steps are kept."""
    out = tmp_path / "out"
    assert gpu_check(script, out, stand_in)[0] == 0
    (out / "artifacts" / config / "manifest.json").unlink()
    code, outcomes = gpu_check(script, out, stand_in, "--resume")
    steps = {name for name in outcomes if name.endswith(f"-{config}")}
    assert code == 0 and among <= steps
    assert ran(outcomes) == {"native"} | steps


def test_resume_tells_a_step_from_one_whose_name_ends_like_it(tmp_path, script, stand_in):
    """bench-kuairand failed, request-bench-kuairand passed: only the first runs again."""
    out = tmp_path / "out"
    code, first = gpu_check(script, out, stand_in, failing="--lengths 1024,4064")
    assert code == 1 and first["bench-kuairand"] == "failed" and first["request-bench-kuairand"] == "ran"
    code, second = gpu_check(script, out, stand_in, "--resume")
    assert code == 0 and ran(second) == {"native", "bench-kuairand"}


def test_resume_runs_every_step_after_the_sources_changed(tmp_path, script, stand_in):
    out = tmp_path / "out"
    assert gpu_check(script, out, stand_in, "--quick")[0] == 0
    (script.parent.parent / "kvexport" / "model.py").write_text("version = 2\n")
    code, outcomes = gpu_check(script, out, stand_in, "--quick", "--resume")
    assert code == 0 and set(ran(outcomes)) == set(outcomes)


def test_what_the_native_build_writes_does_not_count_as_a_source_change(tmp_path, script, stand_in):
    """The native step builds the op library into kvexport/_lib: a resume after it keeps the steps
    that passed (before, the second call of a run always started over)."""
    out = tmp_path / "out"
    assert gpu_check(script, out, stand_in, "--quick")[0] == 0
    (script.parent.parent / "kvexport" / "_lib").mkdir()
    (script.parent.parent / "kvexport" / "_lib" / "libkvexport_ops.so").write_bytes(b"built")
    code, outcomes = gpu_check(script, out, stand_in, "--quick", "--resume")
    assert code == 0 and ran(outcomes) == {"native"}


def test_a_failed_build_is_rebuilt_with_all_its_steps(tmp_path, script, stand_in):
    out = tmp_path / "out"
    code, first = gpu_check(script, out, stand_in, "--quick", failing="hstu-tiny.yaml")
    assert code == 1 and first["build-tiny"] == "failed"
    assert not TINY_STEPS - {"build-tiny", "request-bench-tiny", "serve-tiny"} & set(first)  # they need its package
    code, second = gpu_check(script, out, stand_in, "--quick", "--resume")
    assert code == 0 and ran(second) == {"native"} | TINY_STEPS


def test_an_unknown_option_is_refused_with_the_usage(tmp_path, script, stand_in):
    result = subprocess.run(
        ["bash", str(script), str(tmp_path / "out"), str(stand_in), "--resum"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert re.fullmatch(r"gpu-check: unknown option --resum; usage: scripts/gpu-check\.sh \[OUT\] .*\n", result.stderr)


def test_an_interpreter_that_cannot_import_kvexport_is_refused_before_any_step(tmp_path, script, stand_in):
    (stand_in.parent / "fail.txt").write_text("import kvexport\n")
    result = subprocess.run(
        ["bash", str(script), str(tmp_path / "out"), str(stand_in)], capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stderr.strip()) == (
        2,
        f"gpu-check: {stand_in} cannot import kvexport outside this checkout: install it first "
        f"({stand_in} -m pip install --no-deps -e .)",
    )
    assert not (tmp_path / "out").exists()


def test_an_interpreter_may_be_named_relative_to_the_checkout(tmp_path, script, stand_in):
    """As `.venv/bin/python` is: the script runs every step from the checkout's root."""
    relative = Path("..") / stand_in.name  # the stand-in sits beside the copied tree
    result = subprocess.run(
        ["bash", str(script), str(tmp_path / "out"), str(relative), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "native: passed" in (tmp_path / "out" / "summary.txt").read_text()


@pytest.mark.parametrize("inside", ["benchmarks/results/h100/run", "."])
def test_an_out_inside_the_source_tree_is_refused_before_any_step(tmp_path, script, stand_in, inside):
    """A run's logs, packages and traces are no source: only artifacts/ (ignored by git) may hold them."""
    tree = script.parent.parent
    result = subprocess.run(["bash", str(script), inside, str(stand_in)], capture_output=True, text=True, timeout=60)
    out = (tree / inside).resolve()
    assert (result.returncode, result.stderr) == (
        2,
        f"gpu-check: OUT {out} is inside the source tree: name a directory outside it, or under artifacts/\n",
    )
    assert not (out / "summary.txt").exists() and not (tree / "benchmarks" / "results").exists()


def test_out_defaults_to_artifacts_under_the_checkout(tmp_path, script, stand_in):
    """No OUT: everything goes to artifacts/gpu-check/, which git ignores (PYTHON left at python3,
    here the stand-in first on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(stand_in, bin_dir / "python3")
    (bin_dir / "fail.txt").write_text("")
    result = subprocess.run(
        ["bash", str(script), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert "native: passed" in (script.parent.parent / "artifacts" / "gpu-check" / "summary.txt").read_text()
