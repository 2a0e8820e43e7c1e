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
passed on to it; its exit status is the command's.
"""

from __future__ import annotations

import argparse
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

log = logging.getLogger(__name__)


STUB = "triton_python_backend_stub"  # the Python backend's process that runs a model instance


def distribution() -> Path:
    """The installed tritonserver distribution (nvidia-pytriton's package data; its Python API is not
    used); UserError when the serve extra is not installed."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("kvexport serve needs the serve extra (nvidia-pytriton's tritonserver is not installed): "
                        "pip install 'kvexport[serve]'")
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


def run(repo: Path, options: list[str]) -> int:
    """tritonserver --model-repository REPO OPTIONS, its backend laid out in a temporary directory
    removed when it exits, the routing header forwarded to the model (which checks it); SIGTERM and
    SIGINT passed on (it runs in its own process group, so a terminal's Ctrl-C reaches it once); its
    exit status. Any other way out of here stops it first."""
    from kvexport.serving.triton_router import ROUTING_HEADER

    if not repo.is_dir():
        raise UserError(f"{repo}: no such model repository")
    received: list[int] = []
    process: subprocess.Popen | None = None

    def pass_on(signum, _frame):
        received.append(signum)
        if process is not None:
            process.send_signal(signum)

    previous = {signum: signal.signal(signum, pass_on) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with tempfile.TemporaryDirectory(prefix="kvexport-tritonserver-") as work:
            command, env = prepare(Path(work))
            process = subprocess.Popen([*command, "--model-repository", str(repo.resolve()),
                                        "--http-header-forward-pattern", f"^{ROUTING_HEADER}$",
                                        "--grpc-header-forward-pattern", f"^{ROUTING_HEADER}$", *options],
                                       env=env, process_group=0)
            try:
                if received:  # a signal that came before the server did
                    process.send_signal(received[0])
                return process.wait()
            finally:
                if process.poll() is None:
                    process.terminate()
                    process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m kvexport.serving.tritonserver",
                                     description="Serves the model repository REPO with the serve extra's tritonserver.")
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
