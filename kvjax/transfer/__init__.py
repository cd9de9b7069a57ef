"""Transfers of paged KV caches between instances (disaggregated prefill/decode, docs/layout.md §7).

- :mod:`~kvjax.transfer.topology`: layout probe, TP ratio, replication, source ranks,
  rank offset factor.
- :mod:`~kvjax.transfer.plan`: byte read plans within a page (:func:`plan_reads`) and
  per-(region, block) descriptors.
- :mod:`~kvjax.transfer.execute`: running plans between device groups in one process.
- :mod:`~kvjax.transfer.all_layers`: a request's pages of every layer as one byte row per block
  (what one remote pull of all layers moves).
- :mod:`~kvjax.transfer.remote`: the same across processes over ``jax.experimental.transfer``
  (imported lazily: ``from kvjax.transfer import remote``).
"""
from kvjax.transfer.execute import (assemble_pages, gather_page_bytes, hnd_twin, rank_plan,
                                    receive_into, scatter_page_bytes, transfer_blocks)
from kvjax.transfer.plan import (BlockRead, HeadRun, Read, RegionDescriptor, descriptors,
                                 head_runs, plan_reads, region_descriptors)
from kvjax.transfer.topology import (LayoutProbe, heads_per_rank, is_kv_replicated, local_heads,
                                     probe_layout, rank_offset_factor, remote_spec, source_ranks,
                                     tp_ratio)

__all__ = [
    "Read", "HeadRun", "BlockRead", "RegionDescriptor", "LayoutProbe", "plan_reads", "head_runs",
    "descriptors", "region_descriptors", "probe_layout", "tp_ratio", "is_kv_replicated",
    "heads_per_rank", "local_heads", "source_ranks", "rank_offset_factor", "remote_spec",
    "transfer_blocks", "gather_page_bytes", "scatter_page_bytes", "assemble_pages", "receive_into",
    "rank_plan", "hnd_twin",
]
