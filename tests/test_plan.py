"""The layer plan (``graphs.plan``): DeepSeek-V4.1-Flash's roles as its config states them,
both spellings of the config, DeepSeek-V4 plans on the same path, and plans that cannot
work refused with the layers named."""

from __future__ import annotations

import pytest

from graphs.plan import V41_FLASH_PLAN, LayerPlan, LayerRole

pytestmark = pytest.mark.quick  # the quick subset: python -m pytest -m quick

V41_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0] * 3


def test_v41_flash_roles():
    plan = V41_FLASH_PLAN
    assert len(plan.layers) == 43
    assert [r.layer_id for r in plan.layers if r.compresses] == [2, 8, 14, 20]
    assert [r.layer_id for r in plan.layers if r.indexes] == [2, 8, 14, 20, 24, 28, 32, 36]
    assert plan.layers[0] == LayerRole(0, 0, None, None) and plan.layers[42] == LayerRole(42, 0, None, None)
    assert plan.layers[7] == LayerRole(7, 2, 2, 2) and plan.layers[13] == LayerRole(13, 2, 8, 8)
    assert plan.layers[21] == LayerRole(21, 1, 20, 20)  # L21-23 reuse L20's top-k
    assert plan.layers[24] == LayerRole(24, 1, 20, 24) and plan.layers[27] == LayerRole(27, 1, 20, 24)
    assert plan.layers[39] == LayerRole(39, 1, 20, 36)
    assert [i for i in range(43) if plan.uses_candidates(i)] == [24, 28, 32, 36]  # L20's own top-k is not filtered
    assert (plan.candidate_source, plan.candidate_topk_blocks, plan.candidate_block_size) == (20, 2048, 8)


def test_both_spellings_of_the_config_give_the_plan():
    hf = {"compress_ratios": V41_RATIOS, "kv_source_layer_ids": [2, 8, 14, 20],
          "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "candidate_source_layer_id": 20,
          "candidate_topk_blocks": 2048, "candidate_block_size": 8}
    inference = {"compress_ratios": V41_RATIOS, "kv_source_layers": [2, 8, 14, 20],
                 "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "candidate_source_layer": 20,
                 "candidate_topk_blocks": 2048, "candidate_block_size": 8}
    assert LayerPlan.from_config(hf) == LayerPlan.from_config(inference) == V41_FLASH_PLAN


def test_a_v4_config_makes_every_compressed_layer_its_own_source():
    """V4: no source lists; ratio 4 has an indexer, ratio 128 attends every entry."""
    plan = LayerPlan.from_config({"compress_ratios": [0, 0, 4, 128, 4, 128, 4, 0]})
    assert [r.compresses for r in plan.layers] == [False, False, True, True, True, True, True, False]
    assert [r.index_source for r in plan.layers] == [None, None, 2, None, 4, None, 6, None]
    assert plan.candidate_source is None and not any(plan.uses_candidates(i) for i in range(8))
    layer_types = {"layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]}
    assert [r.ratio for r in LayerPlan.from_config(layer_types).layers] == [0, 4, 128]


@pytest.mark.parametrize("kwargs, says", [
    (dict(ratios=[0, 2, 2], kv_sources=[2], index_sources=[2]), "layer 1 (ratio 2) reads a compressed cache, but no kv source precedes it"),
    (dict(ratios=[2, 1], kv_sources=[0], index_sources=[0]), "layer 1 (ratio 1) reads the compressed cache of layer 0 of ratio 2"),
    (dict(ratios=[2, 2, 2], kv_sources=[0, 2], index_sources=[0]), "layer 2 (ratio 2) attends layer 2's cache with the ids layer 0 picked from layer 0's"),
    (dict(ratios=[0, 2], kv_sources=[0, 1], index_sources=[1]), "kv source layers [0] are not compressed layers"),
    (dict(ratios=[2, 2], kv_sources=[0], index_sources=[1]), "layer 0 (ratio 2) attends with top-k ids, but no index source precedes it"),
    (dict(ratios=[2, 2], kv_sources=[0], index_sources=[0], candidate_source=1, candidate_topk_blocks=4, candidate_block_size=8), "candidate_source 1 must be an index source"),
    (dict(ratios=[2, 2], kv_sources=[0], index_sources=[0], candidate_source=0), "candidate_topk_blocks (0) and candidate_block_size (0) must be >= 1"),
], ids=["reader-before-source", "ratio-mismatch", "ids-of-another-cache", "sliding-source", "index-reader-first",
        "candidate-not-index", "candidate-sizes"])
def test_plans_that_cannot_work_are_refused(kwargs, says):
    with pytest.raises(ValueError, match="cannot work|not compressed") as info:
        LayerPlan.from_lists(**kwargs)
    assert says in str(info.value)


def test_a_reader_names_the_shared_parts_it_was_not_given():
    """A V4.1 reader layer built alone owns no compressor, cache, indexer or ids; run without
    its source's parts it says which to pass."""
    import torch

    from graphs import TINY_V41, CacheConfig, DSV41Attention, StepMetadata

    plan = LayerPlan.from_lists([0, 2, 2], kv_sources=[1], index_sources=[1])
    layer = DSV41Attention(TINY_V41, CacheConfig(2, 4, 32, 4), 2, plan=plan, layer_id=2)
    assert layer.reads_shared and layer.compressor is None and layer.indexer is None
    assert layer.cmp_cache is None and layer.topk_ids is None
    meta = StepMetadata.for_layer(layer)
    meta.update(torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), bucket=1)
    with pytest.raises(ValueError, match=r"pass Shared\(cmp_cache \(layer 1's\), topk \(layer 1's ids"):
        layer(torch.zeros(1, TINY_V41.dim, dtype=torch.bfloat16), meta.inputs(1))
    with pytest.raises(ValueError, match="ratio 2 in the plan, but compress_ratio is 1"):
        DSV41Attention(TINY_V41, CacheConfig(2, 4, 32, 4), 1, plan=plan, layer_id=2)
