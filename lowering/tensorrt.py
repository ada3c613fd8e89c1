"""Torch-TensorRT (``torch_tensorrt.compile(..., ir="dynamo")``) and the ``dsv41`` ops.

Ops whose schema a TensorRT Quick-Deployable Plugin can express (tensor inputs, int / float
attributes, new tensor outputs, nothing mutated, nothing optional) get a plugin and a
converter generated from the schema and fake kernel by
``torch_tensorrt.dynamo.conversion.plugins.custom_op``; the plugin calls the op on
TensorRT's stream. The others (``sparse_mla``: optional tensors and a ``str`` format;
``sparse_mla_out`` / ``write_kv``: they mutate their arguments; ``dcp_combine``: a
collective named by a ``str``) run in PyTorch between TensorRT engines: pass
:func:`torch_executed_ops` to ``torch_tensorrt.compile`` (:func:`compile` does).

Nothing here imports ``torch_tensorrt`` at module import; :func:`register` raises
``ImportError`` with the reason when it is missing. See ``docs/lowering.md`` for the status
on the machines of this project.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import compile_ops  # noqa: F401  (registers torch.ops.dsv41)

OPS = ("sparse_mla", "sparse_mla_out", "topk_to_slots", "dcp_topk_to_slots", "swa_indices",
       "lse_combine", "dcp_combine", "write_kv")
_PLUGIN_ARG_TYPES = ("Tensor", "int", "float", "SymInt")
_registered: list[str] = []


def plugin_unsupported(name: str) -> Optional[str]:
    """Why ``dsv41::name`` cannot become a generated plugin, or ``None`` if it can."""
    schema = getattr(torch.ops.dsv41, name).default._schema
    if schema.is_mutable:
        return "it mutates an argument"
    for arg in schema.arguments:
        if str(arg.type) not in _PLUGIN_ARG_TYPES:
            return f"argument {arg.name!r} has type {arg.type}"
    if not schema.returns or any(str(r.type) != "Tensor" for r in schema.returns):
        return "it does not return only tensors"
    return None


def plugin_ops() -> list[str]:
    """Ops that get a generated TensorRT plugin."""
    return [name for name in OPS if plugin_unsupported(name) is None]


def torch_executed_ops() -> set[str]:
    """``torch_executed_ops`` for ``torch_tensorrt.compile``: the ops TensorRT cannot hold."""
    return {f"torch.ops.dsv41.{name}.default" for name in OPS if plugin_unsupported(name) is not None}


def register() -> list[str]:
    """Generate plugins and converters for :func:`plugin_ops` (idempotent); returns their names."""
    from torch_tensorrt.dynamo.conversion.plugins import custom_op  # ImportError: no torch_tensorrt

    for name in plugin_ops():
        if f"dsv41::{name}" not in _registered:
            custom_op(f"dsv41::{name}", supports_dynamic_shapes=True)
            _registered.append(f"dsv41::{name}")
    return list(_registered)


def compile(module: torch.nn.Module, inputs: list[Any], **kwargs: Any) -> Any:
    """``torch_tensorrt.compile(module, ir="dynamo", ...)`` with the plugins registered and
    the other ``dsv41`` ops kept in PyTorch (added to any ``torch_executed_ops`` given)."""
    import torch_tensorrt

    register()
    kwargs["torch_executed_ops"] = set(kwargs.get("torch_executed_ops", ())) | torch_executed_ops()
    return torch_tensorrt.compile(module, ir="dynamo", inputs=inputs, **kwargs)
