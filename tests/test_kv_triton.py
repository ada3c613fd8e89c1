"""The Triton row store (``compile_ops.kv.triton``: quantize and store each row in one
program) against the plain-torch one (``encode_rows`` / ``encode_index_rows``, then
``index_put_``).

On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set by conftest.py); on a GPU compiled.
Stores are bytes: every case must match the reference exactly.
"""

import inspect

import pytest
import torch

from compile_ops.formats import KV_FORMATS, new_cache
from compile_ops.indexer.cache import INDEX_FORMATS, new_index_cache
from compile_ops.kv.reference import write_values_reference
from compile_ops.kv.triton import write_rows_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rows_to_write(n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes: tiny (under the scale floor), zero, ordinary,
    huge (saturating e4m3 under a unit ``kv_scale``), with exact power-of-two block maxima."""
    gen = torch.Generator().manual_seed(width + n)
    x = torch.randn(n, width, generator=gen) * torch.tensor([1e-7, 0.0, 1.0, 3e3, 0.02, 7.0, 1.0])[:n].unsqueeze(1)
    x[6, :32] = 0.5  # a block whose amax / 448 is a power of two
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_format", sorted(KV_FORMATS))
@pytest.mark.parametrize("page_size,page_gap", [(1, 0), (8, 24), (64, None)])
def test_write_rows(kv_format, page_size, page_gap, dtype):
    """``write_kv``'s Triton row store leaves the same bytes as the reference: each row
    quantized as ``encode_rows`` does, landing at its slot (page gaps honoured); ``-1`` /
    out-of-range rows change nothing. ``fp8_ds_mla`` takes an odd gap: an odd page stride
    puts its bf16 RoPE values at odd addresses (a 2-byte store there faults on a GPU)."""
    if page_gap and kv_format == "fp8_ds_mla":
        page_gap += 1
    cache = new_cache(kv_format, 5, page_size, device=DEVICE, page_gap=page_gap)
    noise = torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8)
    cache.view(torch.uint8).copy_(noise)
    want = cache.clone()
    n = 5 * page_size
    # every other entry of a longer tensor: a strided int64 slots argument
    slots = torch.tensor([n - 1, 9, -1, 9, 0, 9, n, 9, n // 2, 9, -7, 9, 1 % n], device=DEVICE)[::2]
    values = rows_to_write(7, 512, dtype)
    scale = 0.5 if kv_format == "fp8" else 1.0
    write_rows_triton(cache, slots, values, KV_FORMATS[kv_format], scale)
    write_values_reference(want, slots, values, KV_FORMATS[kv_format], scale)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("index_format", sorted(INDEX_FORMATS))
def test_write_index_rows(index_format):
    """``write_index_keys``' rows (128 e4m3 and one fp32 power-of-two scale, or bf16), the
    same bytes as ``encode_index_rows`` and the reference store."""
    cache = new_index_cache(index_format, 3, 4, device=DEVICE)
    cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8))
    want = cache.clone()
    slots = torch.tensor([11, -1, 0, 5, 12, 7, 3], device=DEVICE)
    values = rows_to_write(7, 128, torch.bfloat16)
    fmt = INDEX_FORMATS[index_format]
    write_rows_triton(cache, slots, values, fmt)
    write_values_reference(want, slots, values, fmt)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("fmt", [*KV_FORMATS.values(), *INDEX_FORMATS.values()], ids=lambda f: f.name)
def test_the_row_store_launch_names_every_constexpr(fmt):
    """Inductor, tracing the launch (``torch.compile`` of ``write_kv`` on CUDA, the
    lowering), passes the kernel only the arguments given, no defaults: the launch names
    every constexpr of the row store, for every format."""
    from compile_ops.kv.triton import _layout, _store_rows_kernel

    params = inspect.signature(_store_rows_kernel.fn).parameters.values()  # (JIT or interpreted)
    assert set(_layout(fmt, 0)) == {p.name for p in params if "constexpr" in str(p.annotation)}


def _turn(n: int, width: int, seed: int):
    """A norm weight and per-row angles of the last 64 dims, as a layer's."""
    gen = torch.Generator().manual_seed(seed)
    weight = 1 + 0.1 * torch.randn(width, generator=gen)
    angles = torch.rand(n, 32, generator=gen, dtype=torch.float64) * 60
    return weight.to(DEVICE), angles.cos().float().to(DEVICE), angles.sin().float().to(DEVICE)


@pytest.mark.parametrize("fmt", [*KV_FORMATS.values(), *INDEX_FORMATS.values()],
                         ids=lambda f: f"{'index-' if f in INDEX_FORMATS.values() else ''}{f.name}")
def test_turned_rows_store_the_unfused_bytes(fmt):
    """``graphs::write_turned``'s kernel (the row store given ``turn``) leaves the bytes of
    ``turned_rows`` (norm, then RoPE, in torch) stored by the reference: the fp32 column
    slice of a projection's output, as the layer passes it (rows of another stride)."""
    from graphs.attention import turned_rows

    width = 128 if fmt in INDEX_FORMATS.values() else 512
    new = new_index_cache if width == 128 else new_cache
    cache = new(fmt.name, 3, 4, device=DEVICE)
    cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.view(torch.uint8).shape, dtype=torch.uint8))
    want = cache.clone()
    slots = torch.tensor([11, -1, 0, 5, 12, 7, 3], device=DEVICE)
    values = torch.cat([rows_to_write(7, width, torch.float32), torch.ones(7, 8, device=DEVICE)], 1)[:, :width]
    weight, cos, sin = _turn(7, width, width)
    scale = 0.5 if fmt.name == "fp8" and width == 512 else 1.0
    write_rows_triton(cache, slots, values, fmt, scale, turn=(weight, 1e-6, cos, sin))
    write_values_reference(want, slots, turned_rows(values, weight, 1e-6, cos, sin), fmt, scale)
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


def _write_turned_args(**bad):
    weight, cos, sin = _turn(3, 512, 0)
    args = dict(cache=new_cache("fp8_dsv41", 2, 4, device=DEVICE), slots=torch.tensor([0, -1, 6], device=DEVICE),
                values=torch.randn(3, 512, device=DEVICE), fmt="fp8_dsv41", kv_scale=1.0, weight=weight, eps=1e-6,
                cos=cos, sin=sin)
    args.update(bad)
    return args


def test_write_turned_opcheck():
    from graphs.attention import write_turned  # noqa: F401  (registers graphs::write_turned)

    a = _write_turned_args()
    torch.library.opcheck(torch.ops.graphs.write_turned.default, tuple(a.values()))
    keys = _write_turned_args(cache=new_index_cache("fp4", 2, 4, device=DEVICE), values=torch.randn(3, 128).to(DEVICE),
                              fmt="fp4", weight=torch.ones(128, device=DEVICE))
    torch.library.opcheck(torch.ops.graphs.write_turned.default, tuple(keys.values()))


@pytest.mark.parametrize("bad, error, match", [
    (dict(values=torch.randn(3, 256, device=DEVICE)), ValueError, "KV rows .* or index keys"),
    (dict(values=torch.randn(2, 512, device=DEVICE)), ValueError, "len\\(slots\\)"),
    (dict(fmt="fp9"), ValueError, "kv_format must be one of"),
    (dict(kv_scale=0.0), ValueError, "kv_scale"),
    (dict(eps=-1e-6), ValueError, "eps must be"),
    (dict(eps=float("nan")), ValueError, "eps must be"),
    (dict(weight=torch.ones(128, device=DEVICE)), ValueError, "weight must be \\[512\\]"),
    (dict(weight=torch.ones(1024, device=DEVICE)[::2]), ValueError, "unit stride"),
    (dict(weight=torch.ones(512, dtype=torch.bfloat16, device=DEVICE)), TypeError, "weight must have dtype"),
    (dict(weight=torch.ones(512, device="meta" if DEVICE.type == "cpu" else "cpu")), ValueError, "weight must be on"),
    (dict(cos=torch.zeros(2, 32, device=DEVICE)), ValueError, "cos must be \\[N, P\\]"),
    (dict(sin=torch.zeros(3, 300, device=DEVICE)), ValueError, "sin must be \\[N, P\\]"),
    (dict(cos=torch.zeros(3, 32, dtype=torch.float64, device=DEVICE)), TypeError, "cos must have dtype"),
    (dict(sin=torch.zeros(3, 64, device=DEVICE)[:, ::2]), ValueError, "unit column stride"),
    (dict(values=torch.randn(3, 128, device=DEVICE), weight=torch.ones(128, device=DEVICE), fmt="fp8_dsv41"),
     ValueError, "index_format"),
])
def test_write_turned_refuses_bad_input(bad, error, match):
    """Every argument of ``graphs::write_turned`` is checked before anything is stored."""
    from graphs.attention import write_turned

    args = _write_turned_args(**bad)
    before = args["cache"].clone()
    with pytest.raises(error, match=match):
        write_turned(**args)
    assert torch.equal(args["cache"].view(torch.uint8), before.view(torch.uint8))
