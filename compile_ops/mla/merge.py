"""The LSE merge of ``sparse_mla``'s split-K partials, after either attention kernel.

With ``n_split > 1`` programs per (token, head block) each attention program stores its
normalised partial output and base-2 LSE in the call's workspace; one program per
(token, head) then merges them with the sink: ``L = log2(sum_r 2^L_r + 2^(sink log2 e))``,
``out = sum_r 2^(L_r - L) o_r`` (flash-decoding's split-K reduction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from compile_ops import formats
from compile_ops._launch import launchable
from compile_ops.mla.plan import Launch

LOG2E = tl.constexpr(formats.LOG2E)


@triton.jit(do_not_specialize=["T", "H", "n_split", "has_sink"])
def _combine_kernel(part_o, part_lse, sink, out, lse, T, H, n_split, has_sink, NSP: tl.constexpr, NSC: tl.constexpr,
                    PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr):
    """Merge the ``n_split`` partials ``(o_r, L_r)`` of one (token, head) and its sink:
    ``L = log2(sum_r 2^L_r + 2^sink)``, ``out = sum_r 2^(L_r - L) o_r``, one program per row.

    The four warps lie side by side over the 512 columns, so the sum over partials stays in
    each thread. The partials come in chunks of ``NSC`` rows (``NSP``, a power of two >=
    ``n_split``, in all), the first one loaded before the LSEs' maximum is taken, so the
    program pays about one memory latency. Past 32 partials the chunks hold 16 rows (32-row
    chunks beside the first would take all 255 registers).

    ``PDL``: launched as a programmatic dependent of the Gluon kernel, it waits here for that
    kernel's partials. ``LAUNCH_NEXT``: it lets the stream's next kernel launch at once (a
    programmatic dependent, such as the next call's Gluon kernel, then waits on the device
    for this one; see :func:`merge` for when)."""
    if LAUNCH_NEXT:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()
    i_th = tl.program_id(0)
    i_t, i_h = i_th // H, i_th % H
    o_d = tl.arange(0, 512)
    o_s = tl.arange(0, NSP)
    m_s = o_s < n_split
    # [NSP]
    b_lse = tl.load(part_lse + (o_s * T + i_t) * H + i_h, mask=m_s, other=float("-inf"))
    o_c = tl.arange(0, NSC)
    # [NSC, 512]: the first chunk, loaded before the maximum below needs the LSEs
    b_o = tl.load(part_o + ((o_c * T + i_t) * H + i_h)[:, None] * 512 + o_d[None, :],
                  mask=(o_c < n_split)[:, None], other=0.0)
    b_sink = tl.load(sink + i_h + o_s * 0, mask=tl.where(has_sink != 0, o_s == 0, False), other=float("-inf")) * LOG2E
    b_max = tl.max(tl.maximum(b_lse, b_sink), 0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_den = tl.sum(tl.math.exp2(b_lse - b_max) + tl.math.exp2(b_sink - b_max), 0)
    b_scale = tl.where(b_den > 0, 1.0 / b_den, 0.0)
    b_out = tl.zeros([512], dtype=tl.float32)
    for s0 in tl.static_range(0, NSP, NSC):
        o_c = s0 + tl.arange(0, NSC)
        m_c = o_c < n_split
        o_row = (o_c * T + i_t) * H + i_h
        if s0 > 0:
            b_o = tl.load(part_o + o_row[:, None] * 512 + o_d[None, :], mask=m_c[:, None], other=0.0)
        # [NSC]: the chunk's LSEs again, in the layout of its partials (an L1 hit)
        b_w = tl.math.exp2(tl.load(part_lse + o_row, mask=m_c, other=float("-inf")) - b_max) * b_scale
        b_out += tl.sum(b_w[:, None] * b_o, 0)
    tl.store(out + i_th * 512 + o_d, b_out.to(tl.bfloat16))
    tl.store(lse + i_th, b_max + tl.log2(b_den))


def merge(launch: Launch, out: torch.Tensor, lse: torch.Tensor, *, after_gluon: bool) -> None:
    """Merge ``launch``'s partials into ``out`` and ``lse`` (nothing to do when it ran unsplit).

    ``after_gluon``: the attention kernel was the Gluon one, a programmatic dependent launch
    that lets this merge launch while it still runs (the merge waits on the device). The
    merge in turn lets the next call's Gluon programs take their SMs early, except where
    every program of an unsplit column range has a single block: there the early programs
    only wait and slow the merge down."""
    n_split, (T, H) = launch.n_split, lse.shape
    if isinstance(n_split, int):
        if n_split == 1:
            return
        nsp, rows = triton.next_power_of_2(n_split), T * H
    else:  # symbolic (traced, dynamic T): no guard on n_split; an empty grid when it is 1
        nsp = triton.next_power_of_2(launch.blocks)
        rows = T * H * torch.sym_min(n_split - 1, 1)
    pdl = dict(launch_pdl=True) if after_gluon else {}
    launch_next = after_gluon and (launch.dsplit == 2 or n_split < launch.blocks)
    launchable(_combine_kernel, lse)[(rows,)](
        launch.part_o, launch.part_lse, launch.sink, out, lse,
        T, H, n_split, launch.has_sink, NSP=nsp, NSC=nsp if nsp <= 32 else 16, PDL=after_gluon,
        LAUNCH_NEXT=launch_next, num_warps=4, **pdl,
    )
