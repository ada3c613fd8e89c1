"""Helpers the tests share: caches filled with random rows, index tables with every kind of
invalid entry, the hypothesis example counts of the active profile, step buffers with
pages, and the gloo group of a spawned worker."""

import contextlib
import os

import torch
from hypothesis import settings

from compile_ops import write_kv
from compile_ops.formats import new_cache


def cores_each(processes: int) -> int:
    """Torch threads for each of ``processes`` processes sharing this machine's cores (at least 1)."""
    return max(1, (os.cpu_count() or 1) // processes)


def examples(share: float = 1.0) -> int:
    """``share`` of the active hypothesis profile's examples per property (``ci`` by
    default, ``deep`` with ``pytest --hypothesis-profile deep``; see ``conftest.py``)."""
    return max(1, int(settings.default.max_examples * share))


def make_cache(kv_format, num_pages, page_size, page_gap=0, kv_scale=1.0, device="cpu", gen=None):
    """A cache of random rows of varied magnitude, written with the reference quantizer."""
    cache = new_cache(kv_format, num_pages, page_size, device=device, page_gap=page_gap)
    n = num_pages * page_size
    kv = torch.randn(n, 512, generator=gen, device=device) * torch.rand(n, 1, generator=gen, device=device).mul(3).add(0.05)
    write_kv(cache, torch.arange(n, dtype=torch.int32, device=device), kv, kv_format, kv_scale)
    return cache


def make_indices(T, width, n_slots, device="cpu", gen=None, holes=True):
    """Slots with -1 holes, out-of-range values (negative and >= n_slots), duplicates, random lens (0 included)."""
    lo, hi = (-2, n_slots + 3) if holes else (0, n_slots)
    idx = torch.randint(lo, max(hi, lo + 1), (T, width), generator=gen, dtype=torch.int32, device=device)
    lens = torch.randint(0, width + 1, (T,), generator=gen, dtype=torch.int32, device=device)
    if width > 1:
        idx[:, -1] = idx[:, 0]
    if T > 1:
        lens[0] = 0
    return idx, lens


def grown_meta(layer, rows: int, length: int):
    """Step buffers of ``layer`` whose block tables give request rows ``0 .. rows-1`` the
    pages of ``length`` tokens (for tests that call the layer with their own positions)."""
    from graphs import PageAllocator, StepMetadata

    meta = StepMetadata.for_layer(layer)
    pages = PageAllocator.for_layer(layer)
    for r in range(rows):
        pages.grow(r, length)
    meta.apply_pages(pages.take_changes())
    return meta


@contextlib.contextmanager
def gloo_group(rank: int, world: int, store_path: str):
    """A gloo process group of ``world`` ranks for one spawned test worker, yielding its
    c10d name. On leaving, the ranks meet at a barrier before teardown (no rank tears gloo
    down while a peer still sends). A worker whose checks passed then calls
    ``os._exit(0)``: interpreter finalization can still abort a process in gloo's threads
    after a clean teardown (SIGABRT, "terminate called without an active exception", seen
    once in ~30 CI runs)."""
    import torch.distributed as dist

    torch.set_num_threads(cores_each(world))  # the ranks share the machine's cores
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.barrier()
        dist.destroy_process_group()
