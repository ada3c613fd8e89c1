"""DCP over 2 gloo processes: sharded compressed KV + dcp_topk_to_slots + sparse_mla per rank
+ dcp_combine equals single-rank sparse_mla (the DCP step of docs/design.md)."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import gloo_group

import compile_ops
from compile_ops import write_kv
from compile_ops.formats import new_cache, read_kv

import oracle

pytestmark = pytest.mark.distributed

i32 = torch.int32
T, H_ALL, W, K, R = 6, 8, 5, 12, 2
BLOCK, PAGES_PER_REQ = 4, 6  # compressed entries per page; pages per request row
N_IDS = BLOCK * PAGES_PER_REQ  # request-local compressed ids 0..23


def single_rank_problem(kv_format, seed):
    """The DCP=1 problem: one compressed cache with every entry of both requests."""
    gen = torch.Generator().manual_seed(seed)
    cmp_cache = new_cache(kv_format, R * PAGES_PER_REQ, BLOCK)
    cmp_table = torch.arange(R * PAGES_PER_REQ, dtype=i32).view(R, PAGES_PER_REQ).flip(1).contiguous()
    write_kv(cmp_cache, torch.arange(R * N_IDS, dtype=i32), torch.randn(R * N_IDS, 512, generator=gen), kv_format)
    swa_cache = new_cache(kv_format, 4, 8)
    write_kv(swa_cache, torch.arange(32, dtype=i32), torch.randn(32, 512, generator=gen), kv_format)
    q = torch.randn(T, H_ALL, 512, generator=gen).bfloat16()
    token_to_req = torch.tensor([0, 1, 0, 1, 1, 0], dtype=i32)
    topk = torch.randint(-1, N_IDS, (T, K), generator=gen, dtype=i32)
    topk[1] = -1  # a token whose compressed segment is empty
    is_valid = torch.tensor([True] * (T - 1) + [False])
    swa_idx = torch.randint(0, 32, (T, W), generator=gen, dtype=i32)
    swa_lens = torch.randint(0, W + 1, (T,), generator=gen, dtype=i32)
    sink = torch.randn(H_ALL, generator=gen)
    return q, swa_cache, swa_idx, swa_lens, cmp_cache, cmp_table, topk, token_to_req, is_valid, sink


def shard(cmp_cache, cmp_table, kv_format, rank, world, interleave):
    """This rank's compressed cache: its local ids of each request, in its own pages."""
    local_cache = new_cache(kv_format, R * PAGES_PER_REQ, BLOCK)
    local_table = torch.arange(R * PAGES_PER_REQ, dtype=i32).view(R, PAGES_PER_REQ)
    for r in range(R):
        for c in range(N_IDS):
            if (c // interleave) % world != rank:
                continue
            local = (c // (world * interleave)) * interleave + c % interleave
            src = int(cmp_table[r, c // BLOCK]) * BLOCK + c % BLOCK
            dst = int(local_table[r, local // BLOCK]) * BLOCK + local % BLOCK
            write_kv(local_cache, torch.tensor([dst]), read_kv(cmp_cache, torch.tensor([src]), kv_format), kv_format)
    return local_cache, local_table


def check_combine_against_oracle(rank, world, mode):
    """dcp_combine alone, fp32 partials with empty (-inf) shards, vs the float64 oracle."""
    gen = torch.Generator().manual_seed(11)
    outs = torch.randn(world, T, H_ALL, 64, generator=gen)
    lses = torch.randn(world, T, H_ALL, generator=gen) * 8
    lses[torch.rand(world, T, H_ALL, generator=gen) < 0.3] = -math.inf
    got_out, got_lse = compile_ops.dcp_combine(outs[rank], lses[rank], dist.group.WORLD.group_name, mode)
    want_out, want_lse = oracle.lse_combine(outs, lses)
    heads = slice(rank * H_ALL // world, (rank + 1) * H_ALL // world)
    torch.testing.assert_close(got_out.double(), torch.from_numpy(want_out[:, heads]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse.double(), torch.from_numpy(want_lse[:, heads]), rtol=1e-6, atol=1e-5)


def worker(rank, world, store_path, kv_format, interleave, mode):
    with gloo_group(rank, world, store_path) as group:
        q, swa_cache, swa_idx, swa_lens, cmp_cache, cmp_table, topk, token_to_req, is_valid, sink = single_rank_problem(kv_format, 7)
        scale = 512**-0.5
        cmp_idx, cmp_lens = compile_ops.topk_to_slots(topk, token_to_req, cmp_table, BLOCK, is_valid)
        want_out, want_lse = compile_ops.sparse_mla(q, swa_cache, swa_idx, swa_lens, cmp_cache, cmp_idx, cmp_lens, sink, scale, kv_format)

        local_cache, local_table = shard(cmp_cache, cmp_table, kv_format, rank, world, interleave)
        slots, lens = compile_ops.dcp_topk_to_slots(topk, token_to_req, local_table, BLOCK, is_valid, rank, world, interleave)
        own_swa = swa_lens if rank == 0 else torch.zeros_like(swa_lens)
        out, lse = compile_ops.sparse_mla(
            q, swa_cache, swa_idx, own_swa, local_cache, slots, lens, sink if rank == 0 else None, scale, kv_format
        )
        got_out, got_lse = compile_ops.dcp_combine(out, lse, group, mode)

        heads = slice(rank * H_ALL // world, (rank + 1) * H_ALL // world)
        assert got_out.shape == (T, H_ALL // world, 512) and got_lse.shape == (T, H_ALL // world)
        # partials and the merged output are bf16: three roundings of 2**-8 relative
        bound = 3 * 2**-8 * want_out[:, heads].float().abs().amax(-1, keepdim=True) + 1e-6
        err = (got_out.float() - want_out[:, heads].float()).abs()
        assert (err <= bound).all(), f"rank {rank}: max error {err.max().item()}"
        torch.testing.assert_close(got_lse, want_lse[:, heads], rtol=1e-5, atol=1e-5)
        check_combine_against_oracle(rank, world, mode)
    os._exit(0)  # every check passed (helpers.gloo_group says why exit so)


@pytest.mark.parametrize("mode", ["ag_rs", "a2a"])
@pytest.mark.parametrize("interleave", [1, 4], ids=["I=1", "I=4"])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_dsv41"])
def test_dcp2_equals_single_rank(tmp_path, kv_format, interleave, mode):
    mp.spawn(worker, args=(2, str(tmp_path / "store"), kv_format, interleave, mode), nprocs=2)
