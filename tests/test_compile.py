"""torch.compile(fullgraph=True) traces a chain of dsv41 ops with no graph break."""

import torch
from expecttest import TestCase
from torch._dynamo.utils import counters

import compile_ops
from compile_ops import write_kv
from compile_ops.formats import new_cache

i32 = torch.int32
PAGE, WINDOW, BLOCK = 4, 6, 2


def decode_step(q, positions, token_to_req, swa_table, topk, cmp_table, is_valid, swa_cache, cmp_cache, sink):
    """SWA (with sink) and compressed attention as two partials, merged by LSE."""
    swa_idx, swa_lens = compile_ops.swa_indices(positions, token_to_req, swa_table, PAGE, WINDOW)
    cmp_idx, cmp_lens = compile_ops.topk_to_slots(topk, token_to_req, cmp_table, BLOCK, is_valid)
    scale = q.shape[-1] ** -0.5
    swa_out, swa_lse = compile_ops.sparse_mla(q, swa_cache, swa_idx, swa_lens, None, None, None, sink, scale, "fp8_dsv41")
    empty = torch.zeros_like(swa_lens)
    cmp_out, cmp_lse = compile_ops.sparse_mla(
        q, swa_cache, swa_idx, empty, cmp_cache, cmp_idx, cmp_lens, None, scale, "fp8_dsv41"
    )
    out, lse = compile_ops.lse_combine(torch.stack([swa_out, cmp_out]), torch.stack([swa_lse, cmp_lse]))
    both = compile_ops.sparse_mla(q, swa_cache, swa_idx, swa_lens, cmp_cache, cmp_idx, cmp_lens, sink, scale, "fp8_dsv41")
    return out, lse, both


def inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    T, H = 5, 3
    swa_cache, cmp_cache = new_cache("fp8_dsv41", 8, PAGE), new_cache("fp8_dsv41", 6, BLOCK)
    write_kv(swa_cache, torch.arange(32, dtype=i32), torch.randn(32, 512, generator=gen), "fp8_dsv41")
    write_kv(cmp_cache, torch.arange(12, dtype=i32), torch.randn(12, 512, generator=gen), "fp8_dsv41")
    return (
        torch.randn(T, H, 512, generator=gen).bfloat16(),
        torch.tensor([0, 3, 9, 13, -1], dtype=i32),
        torch.tensor([0, 1, 0, 1, 0], dtype=i32),
        torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]], dtype=i32),
        torch.randint(-1, 7, (T, 4), generator=gen, dtype=i32),
        torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=i32),
        torch.tensor([True, True, True, True, False]),
        swa_cache,
        cmp_cache,
        torch.randn(H, generator=gen),
    )


class TestCompile(TestCase):
    def test_dynamo_graph_holds_the_dsv41_ops_in_order(self):
        graphs = []

        def record(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        torch.compile(decode_step, backend=record, fullgraph=True)(*inputs(0))
        self.assertEqual(len(graphs), 1)
        calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function" and "dsv41" in str(n.target)]
        self.assertExpectedInline(
            "\n".join(calls),
            """\
dsv41.swa_indices.default
dsv41.topk_to_slots.default
dsv41.sparse_mla.default
dsv41.sparse_mla.default
dsv41.lse_combine.default
dsv41.sparse_mla.default""",
        )

    def test_inductor_compiled_chain_matches_eager_with_no_graph_break(self):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(decode_step, fullgraph=True)
        for seed in (1, 2):  # second call with new data reuses the compiled graph
            args = inputs(seed)
            got, want = compiled(*args), decode_step(*args)
            for g, w in zip(got[:2] + got[2], want[:2] + want[2]):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
        self.assertEqual(sum(counters["graph_break"].values()), 0)
        out, lse, (both_out, both_lse) = got
        # merging the SWA and compressed partials by LSE equals attending both at once, up
        # to the bf16 rounding of the two partials and of the merged output (3 roundings)
        bound = 3 * 2**-8 * both_out.float().abs().amax(-1, keepdim=True)
        assert ((out.float() - both_out.float()).abs() <= bound).all()
        torch.testing.assert_close(lse, both_lse, rtol=1e-5, atol=1e-5)


def test_reference_kernel_itself_compiles_whole():
    """The plain-torch reference (the benchmark's torch.compile peer) traces with no break,
    every format's byte gathers included."""
    from compile_ops.mla.inputs import SparseMLAArgs
    from compile_ops.mla.reference import sparse_mla_reference

    def attend(q, swa_cache, swa_idx, swa_lens, cmp_cache, cmp_idx, cmp_lens, sink):
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        lse = torch.empty(q.shape[:2])
        args = SparseMLAArgs(q, swa_cache, swa_idx, swa_lens, cmp_cache, cmp_idx, cmp_lens, sink, 0.05, "fp8_dsv41", 1.0)
        sparse_mla_reference(args, out, lse)
        return out, lse

    q, positions, token_to_req, swa_table, topk, cmp_table, is_valid, swa_cache, cmp_cache, sink = inputs(3)
    swa_idx, swa_lens = compile_ops.swa_indices(positions, token_to_req, swa_table, PAGE, WINDOW)
    cmp_idx, cmp_lens = compile_ops.topk_to_slots(topk, token_to_req, cmp_table, BLOCK, is_valid)
    args = (q, swa_cache, swa_idx, swa_lens, cmp_cache, cmp_idx, cmp_lens, sink)
    torch._dynamo.reset()
    got = torch.compile(attend, fullgraph=True)(*args)
    want = attend(*args)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2**-7)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_an_index_max_over_an_identity_term_takes_a_number():
    """Inductor's tiling analysis substitutes 0 for each index variable but one; ``Max`` over
    an ``Identity`` term then has a number to compare (else the compile raised "The argument
    '-1 + ((0))' is not comparable", ``compile_ops._compat``)."""
    import sympy
    from torch._inductor.utils import sympy_subs
    from torch.utils._sympy.functions import Identity

    x = sympy.Symbol("x0", integer=True, nonnegative=True)
    index = sympy.Max(0, Identity(x) - 1) + 7 * x
    assert [sympy_subs(index, {x: sympy.Integer(v)}) for v in (0, 1, 3)] == [0, 7, 23]
