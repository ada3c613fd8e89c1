"""``dcp_indexer_topk``, ``dcp_indexer_candidates`` and ``dcp_indexer_topk_and_candidates``
over 2 and 4 gloo processes equal ``indexer_topk`` / ``indexer_candidates`` at DCP=1, id for
id: each rank holds its interleaved share of the index keys in its own pages (candidate
blocks span the ranks' entries)."""

import os

import pytest
import torch
import torch.multiprocessing as mp
from helpers import gloo_group

import compile_ops
from compile_ops.indexer.cache import new_index_cache, read_index_keys
from compile_ops.indexer.reference import by_id
from test_indexer import make_problem

pytestmark = pytest.mark.distributed

i32 = torch.int32
T, HI, R, B, PAGE, K = 6, 8, 3, 6, 4, 10
NB, CB = 3, 3  # candidate blocks per token, entries per block (a block spans ranks at I=1)


def shard(cache, table, index_format, rank, world, interleave):
    """This rank's cache and table: its local entries of every request, in pages of its own."""
    local_cache = new_index_cache(index_format, R * B, PAGE)
    local_table = torch.arange(R * B, dtype=i32).view(R, B).flip(0).contiguous()
    for r in range(R):
        for c in range(B * PAGE):
            page = int(table[r, c // PAGE])
            if (c // interleave) % world != rank or page < 0:
                continue
            local = (c // (world * interleave)) * interleave + c % interleave
            dst = int(local_table[r, local // PAGE]) * PAGE + local % PAGE
            key = read_index_keys(cache, torch.tensor([page * PAGE + c % PAGE]), index_format)
            compile_ops.write_index_keys(local_cache, torch.tensor([dst]), key, index_format)
    return local_cache, local_table


def worker(rank, world, store_path, index_format, interleave):
    with gloo_group(rank, world, store_path) as group:
        # integer data: many exact ties, which the merge must order by id; no holes (a hole is a
        # page of the DCP=1 table, which no page of a shard matches)
        for seed in range(3):
            q, weights, cache, table, rows, n = make_problem(index_format, T, HI, R, B, PAGE, seed=seed)
            n = n.clamp(max=B * PAGE)  # counts within the DCP=1 cache (past it, the shards hold more)
            want = compile_ops.indexer_topk(q, weights, cache, table, rows, n, K, index_format)
            local_cache, local_table = shard(cache, table, index_format, rank, world, interleave)
            got = compile_ops.dcp_indexer_topk(q, weights, local_cache, local_table, rows, n, K, index_format,
                                               group, interleave)
            assert torch.equal(got, want), f"rank {rank} seed {seed}:\n{got}\n{want}"
            blocks = compile_ops.indexer_candidates(q, weights, cache, table, rows, n, NB, CB, index_format)
            got = compile_ops.dcp_indexer_candidates(q, weights, local_cache, local_table, rows, n, NB, CB,
                                                     index_format, group, interleave)
            assert torch.equal(got, blocks), f"rank {rank} seed {seed} candidates:\n{got}\n{blocks}"
            want = compile_ops.indexer_topk(q, weights, cache, table, rows, n, K, index_format, blocks, CB)
            got = compile_ops.dcp_indexer_topk(q, weights, local_cache, local_table, rows, n, K, index_format,
                                               group, interleave, blocks, CB)
            assert torch.equal(got, want), f"rank {rank} seed {seed} inside candidates:\n{got}\n{want}"
            want = compile_ops.indexer_topk(q, weights, cache, table, rows, n, K, index_format, order="id")
            got = compile_ops.dcp_indexer_topk(q, weights, local_cache, local_table, rows, n, K, index_format,
                                               group, interleave, order="id")
            assert torch.equal(got, want), f"rank {rank} seed {seed} in id order:\n{got}\n{want}"
            got_ids, got_blocks = compile_ops.dcp_indexer_topk_and_candidates(
                q, weights, local_cache, local_table, rows, n, K, NB, CB, index_format, group, interleave, order="id")
            same = torch.equal(got_ids, want) and torch.equal(got_blocks, by_id(blocks)[0])
            assert same, f"rank {rank} seed {seed} both"
    os._exit(0)  # every check passed (helpers.gloo_group says why exit so)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("interleave", [1, 4], ids=["I=1", "I=4"])
@pytest.mark.parametrize("index_format", ["bf16", "fp8", "fp4"])
def test_dcp_indexer_equals_single_rank(tmp_path, index_format, interleave, world):
    mp.spawn(worker, args=(world, str(tmp_path / "store"), index_format, interleave), nprocs=world)
