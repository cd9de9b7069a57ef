"""torch_bridge: kvjax caches shared zero-copy with PyTorch, and a vLLM-style backend facade.

- :func:`to_torch` / :func:`from_torch`: the same cache buffer in both frameworks.
- :func:`kv_views`, :func:`kv_scale_views`, :func:`nvfp4_split_data_scale`,
  :func:`nvfp4_views`: torch strided views equal to vLLM's formulas.
- :class:`PagedAttentionBackend` + :class:`PagedAttentionMetadata`: vLLM's backend
  API (cache shape / stride order / update / forward) running kvjax's JAX ops.
- :class:`KVJaxAttentionBackend` + :class:`KVJaxAttentionImpl` (:mod:`torch_bridge.vllm_adapter`):
  vLLM's exact calling convention (``impl.forward(layer, query, key, value, kv_cache,
  attn_metadata, output)``, scales on the layer, ``num_actual_tokens``) over that facade.
"""
from torch_bridge.backend import PagedAttentionBackend
from torch_bridge.dlpack import empty_cache, from_torch, to_torch
from torch_bridge.layout import logical_view, physical_tensor
from torch_bridge.metadata import PagedAttentionMetadata
from torch_bridge.vllm_adapter import (KVJaxAttentionBackend, KVJaxAttentionImpl,
                                       KVJaxAttentionMetadata, KVJaxAttentionMetadataBuilder)
from torch_bridge.views import (kv_scale_views, kv_views, nvfp4_sides, nvfp4_split_data_scale,
                                nvfp4_views)

__all__ = [
    "to_torch", "from_torch", "empty_cache", "logical_view", "physical_tensor", "kv_views",
    "kv_scale_views", "nvfp4_split_data_scale", "nvfp4_sides", "nvfp4_views",
    "PagedAttentionBackend", "PagedAttentionMetadata", "KVJaxAttentionBackend",
    "KVJaxAttentionImpl", "KVJaxAttentionMetadata", "KVJaxAttentionMetadataBuilder",
]
