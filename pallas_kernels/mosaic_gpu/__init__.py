"""Mosaic GPU (Hopper, sm90+) kernels for the packed paged KV cache.

Entry points: :func:`ragged_paged_attention` (the semantics of
``kvjax.reference.unified_attention``) and the registry check :func:`supports_attention`
(None = supported, else a one-line reason). Importing this package does not import Mosaic
GPU; the kernel module is loaded on the first call. docs/mosaic_gpu.md has the design.
"""
from pallas_kernels.mosaic_gpu.ragged_attention import (prefer_attention, ragged_paged_attention,
                                                        supports_attention)

__all__ = ["ragged_paged_attention", "supports_attention", "prefer_attention"]
