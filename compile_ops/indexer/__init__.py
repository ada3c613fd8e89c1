"""The indexer: ``cache`` (index-key format), ``ops`` (contract), ``reference`` (meaning),
``triton`` (fast path)."""

from compile_ops.indexer.ops import (dcp_indexer_candidates, dcp_indexer_topk, indexer_candidates, indexer_topk,
                                    write_index_keys)

__all__ = ["dcp_indexer_candidates", "dcp_indexer_topk", "indexer_candidates", "indexer_topk", "write_index_keys"]
