"""A loaded AOTInductor package, called with its inputs as the flat tensors its program takes.

torch's own wrapper (torch._inductor.package.package.AOTICompiledModel) parses the package's call
spec, two serialised pytree specs, on every call: host work every request pays again. The spec
does not change after load, so it is read once here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils import _pytree as pytree


class Program:
    """A package's model. Call it with its positional tensors, as the package was exported
    (kvexport's programs take tensors only); it returns what the exported module returned."""

    def __init__(self, loader: torch._C._aoti.AOTIModelPackageLoader):
        self.loader = loader
        in_spec, self._out_spec = (pytree.treespec_loads(spec) for spec in loader.get_call_spec())
        self.num_inputs = in_spec.num_leaves

    def __call__(self, *tensors: torch.Tensor):
        if len(tensors) != self.num_inputs:
            raise TypeError(f"the package takes {self.num_inputs} tensors, got {len(tensors)}")
        return pytree.tree_unflatten(self.loader.boxed_run(list(tensors)), self._out_spec)

    def get_metadata(self) -> dict[str, str]:
        return self.loader.get_metadata()


def load_program(package: Path, device_index: int, *, single_threaded: bool = False) -> Program:
    """The package's model through torch's loader (model "model", one runner), as a C++ host loads
    it. single_threaded: no runner pool and no events of its own, so that a CUDA graph can capture
    a run (torch's run_single_threaded)."""
    return Program(torch._C._aoti.AOTIModelPackageLoader(str(package), "model", single_threaded, 1, device_index))
