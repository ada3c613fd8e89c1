"""The indexer: ``cache`` (index-key format), ``ops`` (contract), ``reference`` (meaning),
``triton`` (fast path)."""

from compile_ops.indexer.ops import (dcp_indexer_candidates, dcp_indexer_topk, dcp_indexer_topk_and_candidates,
                                    indexer_candidates, indexer_topk, indexer_topk_and_candidates, write_index_keys)

__all__ = ["dcp_indexer_candidates", "dcp_indexer_topk", "dcp_indexer_topk_and_candidates", "indexer_candidates",
           "indexer_topk", "indexer_topk_and_candidates", "write_index_keys"]
