"""The `tritonserver` binary the `serve` extra installs (nvidia-pytriton's), run on a model repository.

What it takes to start it on a repository of kvexport's (kvexport.serving.repository), read from
the installed distribution, never guessed:
- a backend directory holding the Python backend and the Python-backend stub built for this
  interpreter's Python version (the distribution ships one stub per version beside the backend);
- the distribution's own libraries on the loader's path;
- this interpreter's libpython preloaded, in the server's environment only: the stub links
  libpython3.X.so.1.0 by name, and the loader may otherwise find another build of it, whose C code
  then runs this interpreter's standard library (the model fails to load).

The stub's interpreter ignores PYTHONPATH (it starts isolated) and sees the base installation's
site-packages only: a repository served from a virtual environment names the environment's site
directory in its `python_path` parameter (`kvexport triton-repo --python-path`).

`python -m kvexport.serving.tritonserver REPO [tritonserver options]` (what a repository's
`tritonserver` launcher runs) serves REPO so: the backend directory in a temporary directory,
removed when tritonserver exits; the routing header forwarded to the model; SIGTERM and SIGINT
passed on to it; its exit status is the command's. It also watches the models' Python-backend
stubs: Triton neither restarts a stub that died (`kill -KILL`, the OOM killer) nor stops reporting
ready, so every request to its model fails while /v2/health/ready answers 200. A stub that has
ended while its shared-memory region is still there (a model Triton unloads ends its stub and
removes the region; a killed stub leaves it) stops tritonserver, and the command exits 2 with one
line: the server is then gone, as an orchestrator's readiness and liveness probes see.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from kvexport.errors import UserError
from kvexport.serving.triton_router import ROUTING_HEADER

log = logging.getLogger(__name__)


STUB = "triton_python_backend_stub"  # the Python backend's process that runs a model instance
WATCH_S = 1.0  # how often the launcher looks at its stubs
# After a stub died: how long tritonserver may take to exit on SIGTERM before SIGKILL (longer than
# its default exit timeout, 30 s, so that it removes the models' shared memory itself).
STOP_WAIT_S = 40
DEAD_STUB_EXIT = 2


def distribution() -> Path:
    """The installed tritonserver distribution (nvidia-pytriton's package data; its Python API is not
    used); UserError when the serve extra is not installed."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "kvexport serve needs the serve extra (nvidia-pytriton's tritonserver is not installed): "
            "pip install 'kvexport[serve]'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


def site_packages() -> list[str]:
    """This interpreter's site-packages directories that exist: site.getsitepackages() also names
    those a Debian-style Python would use (.../local/lib/python3.X/dist-packages), which a virtual
    environment made from one lacks."""
    return [directory for directory in site.getsitepackages() if os.path.isdir(directory)]


def libpython() -> Path:
    """This interpreter's shared libpython."""
    path = Path(sysconfig.get_config_var("LIBDIR") or "") / (sysconfig.get_config_var("INSTSONAME") or "")
    if not path.is_file():
        raise UserError(f"this Python has no shared libpython ({path}); Triton's Python backend needs one")
    return path


def prepare(workdir: Path) -> tuple[list[str], dict[str, str]]:
    """(command prefix, environment) of tritonserver with its backends laid out under workdir."""
    dist = distribution()
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = dist / "python_backend_stubs" / version / STUB
    if not stub.is_file():
        raise UserError(f"the installed tritonserver has no Python-backend stub for Python {version} ({stub})")
    backend = workdir / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        target = backend / name
        if not target.exists():
            target.symlink_to(dist / "backends" / "python" / name)
    shutil.copy2(stub, backend / STUB)
    env = dict(os.environ)
    libs = dist.parent.parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH", "")]))
    env["LD_PRELOAD"] = " ".join(filter(None, [str(libpython()), env.get("LD_PRELOAD", "")]))
    command = [str(dist / "bin" / "tritonserver"), "--backend-directory", str(workdir / "backends")]
    return command, env


@dataclasses.dataclass(frozen=True)
class Stub:
    """A Python-backend stub process: its pid, its start time (field 22 of /proc/PID/stat, which tells
    a pid reused by another process from the stub), its model's file and its shared-memory region."""

    pid: int
    started: str
    model: str
    region: str

    def running(self) -> bool:
        """Whether the stub still runs: not gone, not a zombie, not another process with its pid."""
        try:
            fields = _stat(Path(f"/proc/{self.pid}"))
            return fields[0] != "Z" and fields[19] == self.started
        except (OSError, IndexError):
            return False

    def has_region(self) -> bool:
        """Whether its shared-memory region exists: Triton removes it when it unloads the model."""
        return (Path("/dev/shm") / self.region).exists()


def stubs(workdir: Path) -> list[Stub]:
    """The Python-backend stubs of the tritonserver whose backend directory `prepare` laid out in
    workdir (their argv: the stub, the model's file, the shared-memory region, ...)."""
    found = []
    executable = os.fsencode(workdir / "backends" / "python" / STUB)
    for process in Path("/proc").glob("[0-9]*"):
        try:
            argv = (process / "cmdline").read_bytes().split(b"\0")
            if argv[0] == executable:
                found.append(Stub(int(process.name), _stat(process)[19], os.fsdecode(argv[1]), os.fsdecode(argv[2])))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return found


def _stat(process: Path) -> list[str]:
    """/proc/PID/stat's fields after the command's name: [0] the state, [19] the start time."""
    return (process / "stat").read_text().rsplit(")", 1)[1].split()


class StubWatch:
    """The rule for a dead Python-backend stub, for both hosts of tritonserver: a stub that has
    ended while its shared-memory region is still there (a model Triton unloads ends its stub and
    removes the region, a moment later; a killed stub leaves it), on two looks in a row."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.seen: dict[int, Stub] = {}  # every stub whose region exists: a stub that dies stays here
        self.suspects: set[int] = set()  # ended with their region left at the last look

    def find(self) -> list[Stub]:
        """Records the stubs running now; returns every stub recorded. A host that knows its models
        are loaded finds them at once, so that a stub killed before the next look is not missed."""
        for stub in stubs(self.workdir):
            self.seen.setdefault(stub.pid, stub)
        return list(self.seen.values())

    def look(self) -> Stub | None:
        """A stub found dead at this look and the one before, else None."""
        self.find()
        self.seen = {pid: stub for pid, stub in self.seen.items() if stub.has_region()}
        ended = {pid for pid, stub in self.seen.items() if not stub.running()}
        dead = next((self.seen[pid] for pid in ended & self.suspects), None)
        self.suspects = ended
        return dead


class Supervisor:
    """tritonserver on a model repository: its backend laid out in `workdir`, the routing header
    forwarded to the model (which checks it), in a process group of its own (a terminal's Ctrl-C
    reaches whoever supervises it, once), its stubs watched (StubWatch). `kvexport serve` and a
    repository's launcher both run tritonserver through it. popen: subprocess.Popen's other
    arguments (where its output goes)."""

    def __init__(self, workdir: Path, repository: Path, options: list[str], **popen):
        command, env = prepare(workdir)
        self.process = subprocess.Popen(
            [
                *command,
                "--model-repository",
                str(repository.resolve()),
                "--http-header-forward-pattern",
                f"^{ROUTING_HEADER}$",
                "--grpc-header-forward-pattern",
                f"^{ROUTING_HEADER}$",
                *options,
            ],
            env=env,
            process_group=0,
            **popen,
        )
        self.watch = StubWatch(workdir)

    def alive(self) -> bool:
        return self.process.poll() is None

    def dead_stub(self) -> Stub | None:
        """A stub of its models that died (StubWatch); Triton would keep reporting ready."""
        return self.watch.look()

    def stop(self, wait_s: float) -> int:
        """SIGTERM, then SIGKILL when it has not exited within wait_s; its exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver did not exit within %d s; killing it", wait_s)
                self.process.kill()
        return self.process.wait()


def run(repo: Path, options: list[str]) -> int:
    """tritonserver --model-repository REPO OPTIONS through a Supervisor whose backend lies in a
    temporary directory removed when it exits; SIGTERM and SIGINT passed on; its exit status, or
    DEAD_STUB_EXIT once a stub died: tritonserver is then stopped (SIGKILL after STOP_WAIT_S). Any
    other way out of here stops it first."""
    if not repo.is_dir():
        raise UserError(f"{repo}: no such model repository")
    received: list[int] = []
    server: Supervisor | None = None

    def pass_on(signum, _frame):
        received.append(signum)
        if server is not None:
            server.process.send_signal(signum)

    previous = {signum: signal.signal(signum, pass_on) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with tempfile.TemporaryDirectory(prefix="kvexport-tritonserver-") as work:
            server = Supervisor(Path(work), repo, options)
            try:
                if received:  # a signal that came before the server did
                    server.process.send_signal(received[0])
                while True:
                    try:
                        return server.process.wait(timeout=WATCH_S)
                    except subprocess.TimeoutExpired:
                        pass
                    dead = server.dead_stub()
                    if dead is not None and not received:
                        log.error(
                            "error: the Python-backend stub of %s (pid %d) died; Triton would keep reporting "
                            "ready while its requests fail: stopping tritonserver",
                            dead.model,
                            dead.pid,
                        )
                        server.stop(STOP_WAIT_S)
                        return DEAD_STUB_EXIT
            finally:
                server.stop(STOP_WAIT_S)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m kvexport.serving.tritonserver",
        description="Serves the model repository REPO with the serve extra's tritonserver.",
    )
    parser.add_argument("repo", type=Path, metavar="REPO")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="tritonserver's options, e.g. --http-port 8000")
    args = parser.parse_args(argv)
    try:
        return run(args.repo, args.options)
    except UserError as exc:
        log.error("error: %s", exc)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
