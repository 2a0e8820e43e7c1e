"""CLI hardening: concurrent and interrupted builds, `run` keeping completed work, early checks of
paths and tolerances, readable reports and logs, progress lines."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

import kvexport.export.build as build
from kvexport.artifact import check_files, open_artifact
from kvexport.commands.cli import main
from kvexport.errors import UserError
from kvexport.model import build_model, random_batch
from kvexport.progress import Progress
from kvexport.trace.report import format_report
from tests.helpers import ROOT
from tests.helpers.configs import TINY

KVEXPORT = [sys.executable, "-m", "kvexport"]


def _start_build(out: Path) -> subprocess.Popen:
    # A shell without job control starts background jobs with SIGINT ignored, and Python keeps an
    # inherited SIG_IGN; reset it so the child turns SIGINT into KeyboardInterrupt as under a terminal.
    return subprocess.Popen(
        [*KVEXPORT, "build", str(TINY), "-o", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _fake_write_artifact(config, staging, checkpoint, device, step_program):
    (staging / "manifest.json").write_text("{}")


# --- 1. builds that race, are interrupted, or find debris -----------------------------------------


def test_build_fails_at_once_while_another_holds_the_lock(tmp_path):
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = subprocess.run(
            [*KVEXPORT, "build", str(TINY), "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: another kvexport build is writing {out} (lock {lock} is held by another process)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock"]  # ours, not removed by the loser


@pytest.mark.slow
def test_two_concurrent_builds_one_wins_and_stale_staging_is_removed(tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / f".out.partial-{_dead_pid()}"
    (dead / "trace").mkdir(parents=True)
    (tmp_path / f"{dead.name}.old").mkdir()
    live = tmp_path / f".out.partial-{os.getpid()}"  # a build still running: must be left alone
    live.mkdir()
    builds = [_start_build(out), _start_build(out)]
    results = [(b.wait(timeout=400), b.stderr.read()) for b in builds]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(stderr for code, stderr in results if code == 2)
    assert len(loser.splitlines()) == 1, loser
    assert f"another kvexport build is writing {out}" in loser or f"{out} already exists" in loser
    assert check_files(open_artifact(out)) > 0  # complete: every manifest file present and intact
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])


@pytest.mark.slow
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_build_leaves_nothing(tmp_path, signum, code):
    out = tmp_path / "out"
    process = _start_build(out)
    staging = tmp_path / f".out.partial-{process.pid}"
    deadline = time.monotonic() + 120
    while not staging.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert staging.exists(), "the build never started staging"
    time.sleep(1.0)  # inside a stage, not at its first line
    process.send_signal(signum)
    assert process.wait(timeout=120) == code, process.stderr.read()
    assert process.stderr.read().splitlines()[-1] == f"error: interrupted by {signal.Signals(signum).name}"
    assert list(tmp_path.iterdir()) == []


# A command interrupted while torch traces under a fake-tensor mode, as `kvexport build` exports
# and compiles: the signal arrives between two traced ops.
_INTERRUPTED_WHILE_TRACING = """
import os, signal, sys
from pathlib import Path
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from kvexport.commands.interrupts import handle_errors
from kvexport.io import cleaned_up_on_abrupt_exit

signal.signal(signal.SIGINT, signal.SIG_DFL)
writing = Path(sys.argv[1])
writing.mkdir()


@handle_errors
def command():
    with cleaned_up_on_abrupt_exit(writing.rmdir):
        with FakeTensorMode():
            x = torch.ones(4, 4)
            os.kill(os.getpid(), int(sys.argv[2]))
            for _ in range(10_000):
                x = torch.where(x > 0, x, 0.0)
    print("the command ran to its end")


command()
"""


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_while_torch_traces_removes_what_was_written_and_exits_cleanly(tmp_path, signum, code):
    """A signal that arrives while torch traces is not raised into torch's dispatcher (raised
    there, it once aborted a build in test_signal_during_build_leaves_nothing: SIGABRT from "one
    FakeTensorMode already exists", the staging directory left): the handler removes what the
    command registered and exits with the signal's status. The command here never removes its
    directory itself, so only that path can."""
    writing = tmp_path / "writing"
    result = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_WHILE_TRACING, str(writing), str(int(signum))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == code, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == f"error: interrupted by {signal.Signals(signum).name}"
    assert "ran to its end" not in result.stdout and not writing.exists()


def test_stale_staging_is_removed_and_live_staging_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "_write_artifact", _fake_write_artifact)
    dead_pid = _dead_pid()
    for name in (f".out.partial-{dead_pid}", f".out.partial-{dead_pid}.old"):
        (tmp_path / name / "trace").mkdir(parents=True)
    live = tmp_path / f".out.partial-{os.getppid()}"  # alive, and not this process (the build's own pid)
    live.mkdir()
    build.build_artifact(TINY, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])


def test_output_that_appears_during_the_build_is_not_replaced(tmp_path, monkeypatch):
    out = tmp_path / "out"

    def someone_else_creates_out(config, staging, checkpoint, device, step_program):
        _fake_write_artifact(config, staging, checkpoint, device, step_program)
        out.mkdir()  # an empty directory: the one thing a plain rename would silently replace

    monkeypatch.setattr(build, "_write_artifact", someone_else_creates_out)
    result = CliRunner().invoke(main, ["build", str(TINY), "-o", str(out)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {out} appeared during the build and was left as it is (use --force to replace it)\n"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and list(out.iterdir()) == []


# --- 2. run keeps completed work ----------------------------------------------------------------


def _over_capacity_batch(config) -> dict:
    """Fewest users at max history whose pages exceed the device tier (as the build's trace does)."""
    users = config.kv_cache.device_pages // config.kv_cache.pages_for(config.model.max_prefix_length) + 1
    assert users <= config.serving.max_batch_size, "hstu-tiny must allow a batch that exceeds its device tier"
    return random_batch(
        config.model,
        seed=4,
        history_lengths=[config.model.max_history_length] * users,
        num_candidates=[1] * users,
        first_user_id=9000,
    ).to_dict()


@pytest.mark.slow
def test_run_keeps_outputs_around_a_refused_batch(tiny_artifact, tiny_config, tiny_checkpoint, tmp_path):
    m = tiny_config.model
    good = [
        random_batch(m, seed=1, history_lengths=[5, 9], num_candidates=[2, 3], first_user_id=7000),
        random_batch(m, seed=2, history_lengths=[4], num_candidates=[4], first_user_id=7100),
    ]
    requests, output = tmp_path / "requests.pt", tmp_path / "out.pt"
    torch.save([good[0].to_dict(), _over_capacity_batch(tiny_config), good[1].to_dict()], requests)
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "--requests", str(requests), "--output", str(output)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: batch 1: KV cache capacity exceeded")
    assert result.stderr.count("\n") == 1
    assert "scored 2/3 batches" in result.stdout
    entries = torch.load(output, weights_only=True)
    assert [e["status"] for e in entries][::2] == ["ok", "ok"]
    assert entries[1]["status"].startswith("KV cache capacity exceeded") and entries[1]["logits"] is None
    assert entries[1]["user_ids"].tolist() == [9000, 9001]
    model = build_model(tiny_config, checkpoint=tiny_checkpoint)
    for entry, batch in zip(entries[::2], good):
        assert entry["user_ids"].tolist() == batch.user_ids.repeat_interleave(batch.num_candidates).tolist()
        with torch.no_grad():
            torch.testing.assert_close(entry["logits"], model(batch), rtol=1e-4, atol=1e-4)


class _RefusingRunner:
    """Stands in for a loaded Package: refuses users from 9000 on as the runtime refuses an over-capacity batch."""

    def __init__(self, artifact):
        self.num_tasks = artifact.config.model.num_tasks

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        pass

    def run(self, batch, index=None):
        if int(batch.user_ids[0]) >= 9000:
            raise UserError("KV cache capacity exceeded: needs 130 pages, the device tier has 72")
        return torch.full((int(batch.num_candidates.sum()), self.num_tasks), float(batch.user_ids[0]))


def test_run_records_each_batch_status_and_writes_the_file(tiny_config, tmp_path, monkeypatch):
    import kvexport.commands.request_file
    import kvexport.host.package

    monkeypatch.setattr(
        kvexport.commands.request_file, "open_artifact", lambda out: SimpleNamespace(config=tiny_config)
    )
    monkeypatch.setattr(kvexport.host.package, "load", lambda artifact, **options: _RefusingRunner(artifact))
    m = tiny_config.model
    batches = [
        random_batch(m, seed=1, history_lengths=[5, 9], num_candidates=[2, 3], first_user_id=7000),
        random_batch(m, seed=4, history_lengths=[8, 8], num_candidates=[1, 1], first_user_id=9000),
        random_batch(m, seed=2, history_lengths=[4], num_candidates=[4], first_user_id=7100),
        random_batch(m, seed=5, history_lengths=[3], num_candidates=[2], first_user_id=9100),
    ]
    requests, output = tmp_path / "requests.pt", tmp_path / "out.pt"
    torch.save([b.to_dict() for b in batches], requests)
    result = CliRunner().invoke(main, ["run", str(tmp_path), "--requests", str(requests), "--output", str(output)])
    assert result.exit_code == 2
    assert result.stdout == f"scored 2/4 batches -> {output}\n"
    assert result.stderr == (
        "error: batch 1: KV cache capacity exceeded: needs 130 pages, the device tier has 72 "
        f"(2 of 4 batches refused; each batch's status is in {output})\n"
    )
    entries = torch.load(output, weights_only=True)
    assert [e["status"] for e in entries] == ["ok", entries[1]["status"], "ok", entries[1]["status"]]
    assert entries[1]["status"] == "KV cache capacity exceeded: needs 130 pages, the device tier has 72"
    for entry, batch in zip(entries, batches):
        rows = batch.user_ids.repeat_interleave(batch.num_candidates)
        assert torch.equal(entry["user_ids"], rows)
        refused = int(batch.user_ids[0]) >= 9000
        assert (entry["logits"] is None) if refused else entry["logits"].shape == (len(rows), m.num_tasks)


# --- 3. small confusions ------------------------------------------------------------------------


@pytest.mark.slow
def test_inspect_shows_dtypes_and_shapes(tiny_artifact):
    for target in (tiny_artifact, tiny_artifact / "model.pt2"):
        text = CliRunner().invoke(main, ["inspect", str(target)])
        assert text.exit_code == 0, text.output
        lines = [" ".join(line.split()) for line in text.stdout.splitlines()]
        assert "inputs: user_ids int64 [B] on cpu" in lines
        assert "context_ids int64 [B, 3] on cpu" in lines
        assert "output: logits float32 [sum(num_candidates), 3] on cpu" in lines
        info = json.loads(CliRunner().invoke(main, ["inspect", str(target), "--json"]).stdout)
        assert info["signature"]["inputs"][2] == {
            "name": "item_ids",
            "dtype": "int64",
            "shape": ["sum(history_lengths)"],
            "device": "cpu",
        }


@pytest.mark.parametrize(
    "command", [["verify"], ["replay"], ["soak"], ["run", "--requests", "r.pt", "--output", "o.pt"]]
)
def test_a_file_given_for_the_artifact_directory_is_named(tmp_path, command):
    package = tmp_path / "model.pt2"
    package.write_bytes(b"not a directory")
    result = CliRunner().invoke(main, [command[0], str(package), *command[1:]])
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: {package} is a file; kvexport {command[0]} takes the artifact directory "
        "(the one holding manifest.json)\n"
    )


@pytest.mark.parametrize(
    "args,option",
    [
        (["verify", "{artifact}", "--json", "{missing}/r.json"], "--json"),
        (["soak", "{artifact}", "--json", "{missing}/r.json"], "--json"),
        (["run", "{artifact}", "--requests", "r.pt", "--output", "{missing}/o.pt"], "--output"),
        (["bench", "{artifact}", "--plot", "{missing}/p.png"], "--plot"),
        (["init-checkpoint", str(TINY), "-o", "{missing}/c.pt"], "-o"),
    ],
)
def test_output_paths_are_checked_before_any_work(tmp_path, args, option):
    missing = tmp_path / "no-such-dir"
    argv = [a.format(artifact=tmp_path / "artifact", missing=missing) for a in args]
    started = time.monotonic()
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2
    target = Path(argv[argv.index(option) + 1])
    assert result.stderr == f"error: cannot write {option} {target}: directory {missing} does not exist\n"
    assert result.stdout == "" and time.monotonic() - started < 5


def test_output_path_that_is_a_directory_is_refused(tmp_path):
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "missing"), "--json", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == f"error: cannot write --json {tmp_path}: it is a directory\n"


def test_report_table_never_cuts_a_word():
    comparison = {"max_abs": 0.0, "max_rel": 0.0}
    descriptions = [
        "mixed warm and cold users after heavy eviction, onboarded from the host tier, batch 4",
        "a description of exactly forty-seven characters",
    ]
    steps = [
        {
            "index": i,
            "batch_size": 1,
            "description": d,
            "vs_cached": comparison,
            "vs_full": comparison,
            "vs_reference": comparison,
            "hit_tokens": 0,
            "recomputed_tokens": 0,
            "latency_ms": 1.0,
            "passed": True,
        }
        for i, d in enumerate(descriptions)
    ]
    text = format_report(
        {"steps": steps, "passed": True, "runner": "python", "atol": 1e-4, "rtol": 1e-4, "files_checked": 3}
    )
    words = set(text.split())
    for description in descriptions:
        assert set(description.split()) <= words, description
    assert len(text.splitlines()) == 1 + 2 + 1 + 1  # header, 2 rows, 1 continuation line, verdict


def test_verbose_logs_debug_for_kvexport_only(tmp_path):
    script = (
        "import logging, sys\n"
        "from kvexport.commands.cli import main\n"
        f"main(['-v', 'show-config', {str(TINY)!r}], standalone_mode=False)\n"
        "logging.getLogger('filelock').debug('third-party debug line')\n"
        "logging.getLogger('kvexport.anything').debug('kvexport debug line')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "DEBUG kvexport.anything: kvexport debug line" in result.stderr
    assert "third-party debug line" not in result.stderr


def test_cuda_refusal_names_where_the_device_came_from(tmp_path):
    config = tmp_path / "cuda.yaml"
    config.write_text(TINY.read_text().replace("device: cpu", "device: cuda"))
    from_config = CliRunner().invoke(main, ["build", str(config), "-o", str(tmp_path / "a")])
    from_flag = CliRunner().invoke(main, ["build", str(TINY), "-o", str(tmp_path / "b"), "--device", "cuda"])
    assert from_config.exit_code == from_flag.exit_code == 2
    assert from_config.stderr.startswith(f"error: device cuda (from serving.device in {config}): ")
    assert from_flag.stderr.startswith("error: device cuda (from the --device flag): ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cuda.yaml"]


def test_progress_logs_at_most_every_interval_and_at_the_end(caplog):
    now = [100.0]
    logger = logging.getLogger("kvexport.test-progress")
    with caplog.at_level(logging.INFO, logger=logger.name):
        with Progress("verify", 6, logger, interval=5.0, clock=lambda: now[0]) as progress:
            for seconds in (1.0, 1.0, 4.0, 1.0, 1.0, 1.0):  # a line due after 6 s, then only the end's
                now[0] += seconds
                progress.step()
    assert [r.getMessage() for r in caplog.records] == [
        "verify: 3/6 steps, 6.0 s elapsed",
        "verify: 6/6 steps, 9.0 s elapsed",
    ]


# --- 4. tolerances ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["verify", "replay"])
@pytest.mark.parametrize("option", ["--atol", "--rtol"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1e-6", "abc"])
def test_tolerance_must_be_finite_and_non_negative(tmp_path, command, option, value):
    result = CliRunner().invoke(main, [command, str(tmp_path / "missing"), option, value])
    assert result.exit_code == 2
    assert result.stderr == f"error: {option} must be a finite number >= 0, got {value}\n"


def test_progress_without_total_and_the_lock_helper(tmp_path, caplog):
    from kvexport.io import exclusive_lock

    logger = logging.getLogger("kvexport.test-progress")
    with caplog.at_level(logging.INFO, logger=logger.name):
        Progress("trace", None, logger, clock=lambda: 0.0).finish()
    assert caplog.records[-1].getMessage() == "trace: 0 steps, 0.0 s elapsed"
    lock = tmp_path / "x.lock"
    with exclusive_lock(lock, "busy"):
        with pytest.raises(UserError, match="^busy .lock .* is held by another process.$"):
            with exclusive_lock(lock, "busy"):
                pass
        assert lock.exists()
    assert not lock.exists()
