"""How the ``dsv41`` ops lower: Inductor integration, AOTInductor packaging, Torch-TensorRT.

Importing this package installs the Inductor rules of :mod:`lowering.inductor` (the Triton
paths of the ops are traced into Inductor's generated code on CUDA). :mod:`lowering.aoti`
exports the attention layer's decode step and packages it for AOTInductor
(``python -m lowering.aoti --out step.pt2``); :mod:`lowering.tensorrt` registers the ops
with Torch-TensorRT when ``torch_tensorrt`` imports. See ``docs/lowering.md``.
"""

from lowering import inductor
from lowering.inductor import inline_triton, install

install()

__all__ = ["inductor", "inline_triton", "install"]
