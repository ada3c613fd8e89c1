"""Run ``indexer_topk``'s Triton kernels on a cache with holes and out-of-range block-table
entries, for ``compute-sanitizer --tool memcheck python tests/scripts/indexer_memcheck.py``.

Every page id past the cache, every ``-1`` and every count past the table must be skipped
without a read outside the cache or the table; the ids are checked against the reference."""

import torch

import compile_ops
from compile_ops.indexer.cache import new_index_cache

i32 = torch.int32
gen = torch.Generator(device="cuda").manual_seed(0)
cache = new_index_cache("fp8", 40, 64, device="cuda")
compile_ops.write_index_keys(cache, torch.arange(40 * 64, device="cuda"),
                             torch.randint(-7, 8, (40 * 64, 128), device="cuda", generator=gen).float(), "fp8")
table = torch.randint(0, 40, (4, 12), device="cuda", dtype=i32, generator=gen)
table[0, 3] = -1
table[1, 5] = 40  # one past the cache
table[2, 0] = 1 << 30
q = torch.randint(-2, 3, (6, 64, 128), device="cuda", generator=gen).bfloat16()
weights = torch.randint(-3, 4, (6, 64), device="cuda", generator=gen).float()
rows = torch.tensor([0, 1, 2, 3, 7, -1], device="cuda", dtype=i32)
n = torch.tensor([700, 12 * 64 + 100, 300, 0, 50, 20], device="cuda", dtype=i32)
got = compile_ops.indexer_topk(q, weights, cache, table, rows, n, 512, "fp8")
with compile_ops.use_backends(indexer="reference"):
    want = compile_ops.indexer_topk(q, weights, cache, table, rows, n, 512, "fp8")
torch.cuda.synchronize()
assert torch.equal(got, want), "ids differ from the reference"
print("indexer memcheck run: ids equal the reference")
