"""Which layer of a DeepSeek-V4 / V4.1 model owns which shared artifact: the layer plan.

DeepSeek-V4.1's layers share work (DeepSeek-V4.1's ``inference/model.py``; the layer
roles of its ``config.json``): only the **kv sources** (V4.1-Flash: layers 2, 8, 14, 20)
run a compressor and own a compressed cache and its index keys; every other compressed
layer reads the compressed cache of the most recent kv source at or before it. Only the
**index sources** (2, 8, 14, 20, 24, 28, 32, 36) run an indexer; the other compressed
layers attend with the top-k ids of the most recent index source. The **candidate source**
(20) keeps ``candidate_topk_blocks`` blocks of ``candidate_block_size`` positions, and the
index sources after it pick their top-k inside them. Sliding-only layers (ratio 0) share
nothing. A DeepSeek-V4 model has no such lists: every compressed layer is its own kv source,
and every one with an indexer (not V4's dense ratio 128) its own index source.

:class:`LayerPlan` holds that as data, read from a ``config.json`` in either spelling
(``kv_source_layer_ids`` / ``kv_source_layers``, ``index_source_layer_ids`` /
``index_source_layers``, ``candidate_source_layer_id`` / ``candidate_source_layer``,
``candidate_topk_blocks``, ``candidate_block_size``), and refuses plans that cannot work
(a reader before any source, a reader whose ratio differs from its source's, an index
reader attending a cache its ids are not of), naming the layers. Same ratio means the same
compressed block size (``CacheConfig.block_size``), so a reader's pages are its source's.

Example::

    >>> from graphs.plan import V41_FLASH_PLAN
    >>> V41_FLASH_PLAN.layers[5]
    LayerRole(layer_id=5, ratio=2, kv_source=2, index_source=2)
    >>> [r.layer_id for r in V41_FLASH_PLAN.layers if r.indexes]
    [2, 8, 14, 20, 24, 28, 32, 36]
    >>> V41_FLASH_PLAN.candidate_source, V41_FLASH_PLAN.uses_candidates(24), V41_FLASH_PLAN.uses_candidates(14)
    (20, True, False)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from graphs.checkpoint import layer_ratios, read_config

DENSE_RATIOS = (128,)
"""Ratios whose layers attend every compressed entry, without an indexer (V4's ratio 128)."""


@dataclass(frozen=True)
class LayerRole:
    """One layer's place in the plan.

    ``kv_source``: the layer whose compressed cache (and index keys) this layer reads,
    itself when it runs the compressor; ``index_source``: the layer whose top-k ids it
    attends with, itself when it runs the indexer. Both ``None`` for a sliding-only layer
    (``ratio == 0``); ``index_source`` ``None`` for a dense layer (every entry, no indexer).
    """

    layer_id: int
    ratio: int
    kv_source: Optional[int]
    index_source: Optional[int]

    @property
    def compresses(self) -> bool:
        """Runs the compressor and owns a compressed cache and index-key cache."""
        return self.kv_source == self.layer_id

    @property
    def indexes(self) -> bool:
        """Runs the indexer and publishes top-k ids."""
        return self.index_source == self.layer_id


@dataclass(frozen=True)
class LayerPlan:
    """Every layer's :class:`LayerRole`, and the two-level candidates (``candidate_source``
    ``None``: none).

    Build it with :meth:`from_config` (a checkpoint's ``config.json``) or
    :meth:`from_lists`; the constructor checks it and raises ``ValueError`` naming the
    layers of a plan that cannot work.
    """

    layers: tuple[LayerRole, ...]
    candidate_source: Optional[int] = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0

    def __post_init__(self) -> None:
        problems = []
        by_id = {r.layer_id: r for r in self.layers}
        if [r.layer_id for r in self.layers] != list(range(len(self.layers))):
            problems.append("layer ids must be 0 .. n-1 in order")
        for r in self.layers:
            where = f"layer {r.layer_id} (ratio {r.ratio})"
            if r.ratio == 0:
                if r.kv_source is not None or r.index_source is not None:
                    problems.append(f"{where} is sliding-only: it has no kv or index source")
                continue
            src = by_id.get(r.kv_source) if r.kv_source is not None else None
            if src is None or r.kv_source > r.layer_id:
                problems.append(f"{where} reads a compressed cache, but no kv source precedes it")
                continue
            if not src.compresses:
                problems.append(f"{where} reads layer {r.kv_source}'s cache, which does not compress")
            elif src.ratio != r.ratio:
                problems.append(f"{where} reads the compressed cache of layer {src.layer_id} of ratio {src.ratio}: "
                                f"a reader's ratio (and so its block size) must be its source's")
            if r.compresses and r.ratio not in DENSE_RATIOS and not r.indexes:
                problems.append(f"{where} is a kv source of an indexed ratio: it must be an index source too "
                                f"(its index keys are its indexer's)")
            if r.ratio in DENSE_RATIOS:
                if r.index_source is not None:
                    problems.append(f"{where} attends every entry: it has no index source")
                continue
            idx = by_id.get(r.index_source) if r.index_source is not None else None
            if idx is None or r.index_source > r.layer_id:
                problems.append(f"{where} attends with top-k ids, but no index source precedes it")
            elif not idx.indexes:
                problems.append(f"{where} takes its ids from layer {r.index_source}, which runs no indexer")
            elif idx.kv_source != r.kv_source:
                problems.append(f"{where} attends layer {r.kv_source}'s cache with the ids layer {idx.layer_id} "
                                f"picked from layer {idx.kv_source}'s")
        if self.candidate_source is not None:
            c = by_id.get(self.candidate_source)
            if c is None or not c.indexes:
                problems.append(f"candidate_source {self.candidate_source} must be an index source")
            if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
                problems.append(f"candidate_topk_blocks ({self.candidate_topk_blocks}) and candidate_block_size "
                                f"({self.candidate_block_size}) must be >= 1 with a candidate source")
        if problems:
            raise ValueError("the layer plan cannot work:\n  " + "\n  ".join(problems))

    @classmethod
    def from_lists(cls, ratios: Sequence[int], kv_sources: Optional[Sequence[int]] = None,
                   index_sources: Optional[Sequence[int]] = None, candidate_source: Optional[int] = None,
                   candidate_topk_blocks: int = 0, candidate_block_size: int = 0) -> "LayerPlan":
        """Each layer reads the most recent source at or before it (DeepSeek-V4.1's rule).
        ``None`` lists (DeepSeek-V4): every compressed layer is its own kv source, every
        compressed layer with an indexer its own index source."""
        ratios = [int(r) for r in ratios]
        compressed = [i for i, r in enumerate(ratios) if r]
        kv = set(compressed if kv_sources is None else kv_sources)
        idx = set([i for i in compressed if ratios[i] not in DENSE_RATIOS] if index_sources is None else index_sources)
        for name, ids in (("kv", kv), ("index", idx)):
            bad = sorted(i for i in ids if not 0 <= i < len(ratios) or not ratios[i])
            if bad:
                raise ValueError(f"{name} source layers {bad} are not compressed layers of the {len(ratios)} "
                                 f"(ratios {ratios})")
        roles, last_kv, last_idx = [], None, None
        for i, r in enumerate(ratios):
            if i in kv:
                last_kv = i
            if i in idx:
                last_idx = i
            if not r:
                roles.append(LayerRole(i, 0, None, None))
            else:
                roles.append(LayerRole(i, r, last_kv, None if r in DENSE_RATIOS else last_idx))
        return cls(tuple(roles), candidate_source, candidate_topk_blocks, candidate_block_size)

    @classmethod
    def from_config(cls, config: Union[Mapping, str, os.PathLike]) -> "LayerPlan":
        """The plan of a ``config.json`` (a dict, the file, or its folder), in either
        spelling (module doc); a config without source lists is a DeepSeek-V4 plan."""
        c = read_config(config)

        def get(*keys):
            return next((c[k] for k in keys if c.get(k) is not None), None)

        return cls.from_lists(layer_ratios(c), get("kv_source_layer_ids", "kv_source_layers"),
                              get("index_source_layer_ids", "index_source_layers"),
                              get("candidate_source_layer_id", "candidate_source_layer"),
                              int(get("candidate_topk_blocks") or 0), int(get("candidate_block_size") or 0))

    def uses_candidates(self, layer_id: int) -> bool:
        """Whether index source ``layer_id`` picks its top-k inside the candidate blocks
        (the index sources after the candidate source; the candidate source's own top-k is
        not filtered)."""
        return (self.candidate_source is not None and self.layers[layer_id].indexes
                and layer_id > self.candidate_source)


# DeepSeek-V4.1-Flash (its config.json): 40 layers and 3 MTP layers; ratio 0 for layers 0-1
# and the MTP layers, 2 for 2-19, 1 for 20-39
V41_FLASH_PLAN = LayerPlan.from_lists(
    [0, 0] + [2] * 18 + [1] * 20 + [0] * 3, kv_sources=[2, 8, 14, 20], index_sources=[2, 8, 14, 20, 24, 28, 32, 36],
    candidate_source=20, candidate_topk_blocks=2048, candidate_block_size=8)
