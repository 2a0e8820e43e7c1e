"""kvexport: ship an HSTU ranking model with a user-history KV cache as an AOTInductor package.

The Python API of a built package (docs/hosting.md, *The Python API*):

    import kvexport

    with kvexport.load("artifacts/hstu-tiny") as pkg:
        logits = pkg.score(batch)

`import kvexport` stays cheap: torch is imported by load().
"""

from __future__ import annotations

__version__ = "0.1.0"

TYPE_CHECKING = False  # typing is not imported here: `import kvexport` stays cheap
if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from kvexport.artifact import Artifact
    from kvexport.host.package import Package


def load(
    out: str | Path | Artifact,
    device: torch.device | str | None = None,
    *,
    check_files: bool = True,
    remote: str | None = None,
    remote_write: str = "on_evict",
    step_program: bool = True,
    cuda_graphs: bool = True,
) -> Package:
    """Loads a built artifact directory (`kvexport build -o OUT`) and returns its `Package`.

    device: None runs it on the device it was built for; any other device raises UserError.
    check_files: check every file's sha256 and the manifest against the package first (as
    `kvexport verify`). remote: a shared remote KV tier, "redis://[[user]:password@]host[:port][/db]";
    remote_write: "on_evict" or "after_batch". step_program: score through the artifact's step.pt2
    when it has one (CUDA packages), cuda_graphs: replay it as CUDA graphs. See
    kvexport.host.package.load.
    """
    from kvexport.host.package import load as _load

    return _load(
        out,
        device,
        check_files=check_files,
        remote=remote,
        remote_write=remote_write,
        step_program=step_program,
        cuda_graphs=cuda_graphs,
    )


def __getattr__(name: str):
    if name == "Package":  # the class, for annotations and isinstance; imports torch
        from kvexport.host.package import Package

        return Package
    raise AttributeError(f"module 'kvexport' has no attribute {name!r}")
