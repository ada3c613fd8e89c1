"""DeepSeek-V4.1 attention ops, native to ``torch.compile`` and CUDA graphs.

Importing this package registers the ``torch.ops.dsv41`` custom ops:

* :func:`sparse_mla` / :func:`sparse_mla_out` -- sparse MLA over an SWA and a compressed
  segment with an attention sink, base-2 LSE (:func:`sparse_mla_workspace`: its scratch).
* :func:`topk_to_slots`, :func:`dcp_topk_to_slots`, :func:`swa_indices` -- index
  conversion to paged-cache slots.
* :func:`lse_combine`, :func:`dcp_combine` -- merging partial attention by LSE, locally
  and across a decode-context-parallel group.
* :func:`write_kv` -- quantizing rows into a paged KV cache.
* :func:`write_index_keys`, :func:`indexer_topk`, :func:`dcp_indexer_topk` -- the indexer's
  paged fp8 index-key cache and its length-bounded top-k; :func:`indexer_candidates`,
  :func:`dcp_indexer_candidates` -- DeepSeek-V4.1's candidate blocks (two-level selection);
  :func:`indexer_topk_and_candidates`, :func:`dcp_indexer_topk_and_candidates` -- both
  from one scoring (V4.1's candidate source layer).
* :func:`fp8_linear` -- a linear of DeepSeek's block-scaled FP8 weights (128 x 128 fp32 or
  32 x 32 ue8m0 scales); :func:`bf16_linear` -- a bf16 linear, a GEMV at one token on CUDA.

Backends are chosen with :data:`config` / :func:`use_backends` and reported by
:func:`backend_for`; KV-cache formats live in :mod:`compile_ops.formats`.
"""

import inspect

from compile_ops.backends import BackendConfig, backend_for, config, use_backends
from compile_ops.combine import dcp_combine, lse_combine
from compile_ops.formats import KV_FORMATS, read_kv
from compile_ops.kv import write_kv
from compile_ops.indexer import (dcp_indexer_candidates, dcp_indexer_topk, dcp_indexer_topk_and_candidates,
                                 indexer_candidates, indexer_topk, indexer_topk_and_candidates, write_index_keys)
from compile_ops.linear import bf16_linear, fp8_linear
from compile_ops.slots import dcp_topk_to_slots, swa_indices, topk_to_slots
from compile_ops.mla import sparse_mla, sparse_mla_out, sparse_mla_workspace

__version__ = "0.1.0"

# a torch.library custom op is called through CustomOpDef.__call__(*args, **kwargs): give
# inspect.signature, help() and editors the op's own signature
for _op in (bf16_linear, dcp_combine, dcp_indexer_candidates, dcp_indexer_topk, dcp_indexer_topk_and_candidates, dcp_topk_to_slots,
            fp8_linear, indexer_candidates, indexer_topk, indexer_topk_and_candidates, lse_combine, sparse_mla,
            sparse_mla_out, swa_indices, topk_to_slots, write_index_keys, write_kv):
    _op.__signature__ = inspect.signature(_op._init_fn)
del _op

__all__ = [
    "__version__",
    "BackendConfig",
    "KV_FORMATS",
    "backend_for",
    "bf16_linear",
    "config",
    "dcp_combine",
    "dcp_indexer_candidates",
    "dcp_indexer_topk",
    "dcp_indexer_topk_and_candidates",
    "dcp_topk_to_slots",
    "fp8_linear",
    "indexer_candidates",
    "indexer_topk",
    "indexer_topk_and_candidates",
    "lse_combine",
    "read_kv",
    "sparse_mla",
    "sparse_mla_out",
    "sparse_mla_workspace",
    "swa_indices",
    "topk_to_slots",
    "use_backends",
    "write_index_keys",
    "write_kv",
]
