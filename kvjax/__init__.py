"""kvjax: the packed paged KV-cache layout of LLM serving, as functional JAX.

The cache value that flows is the *physical* array of a :class:`KVCacheSpec`;
the spec (static, hashable) carries layout and cache dtype.
"""
from kvjax.attention import unified_attention
from kvjax.attention_step import write_and_attend
from kvjax.cache_ops import read_kv, write_kv
from kvjax.formats import CACHE_FORMATS, CacheFormat, get_format
from kvjax.legacy import from_legacy_5d, to_legacy_5d
from kvjax.registry import explain
from kvjax.spec import (KVCacheSpec, LAYOUTS, MLACacheSpec, ViewGeometry, get_kv_cache_shape,
                        get_kv_cache_stride_order, get_mla_kv_cache_shape)
from kvjax.views import (dequantize_pages, kv_scale_views, kv_views, nvfp4_sides,
                         nvfp4_split_data_scale, token_major)
from kvjax import reference, registry, sharding, transfer
from kvjax.sharding import cache_sharding, sharded_unified_attention, sharded_write_kv
from kvjax.transfer import plan_reads, transfer_blocks

__version__ = "0.1.0"

__all__ = [
    "KVCacheSpec", "MLACacheSpec", "ViewGeometry", "CacheFormat", "CACHE_FORMATS", "LAYOUTS",
    "get_format", "get_kv_cache_shape", "get_kv_cache_stride_order", "get_mla_kv_cache_shape",
    "write_kv", "read_kv", "unified_attention", "write_and_attend", "explain", "registry", "from_legacy_5d",
    "to_legacy_5d",
    "kv_views", "kv_scale_views", "nvfp4_sides", "nvfp4_split_data_scale", "dequantize_pages",
    "token_major", "reference", "transfer", "sharding", "cache_sharding", "sharded_write_kv",
    "sharded_unified_attention", "plan_reads", "transfer_blocks",
]

from kvjax import paging  # noqa: E402
from kvjax.paging import (BlockAllocator, BlockTables, OutOfBlocksError, StepMetadata,  # noqa: E402
                          StepShapes, build_step_metadata, slot_mapping)
__all__ += ["paging", "BlockAllocator", "BlockTables", "OutOfBlocksError", "StepShapes",
            "StepMetadata", "build_step_metadata", "slot_mapping"]
