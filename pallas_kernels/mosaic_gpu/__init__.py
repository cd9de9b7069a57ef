"""Mosaic GPU (Hopper, sm90+) kernels for the packed paged KV cache.

Entry points: :func:`unified_attention` (the semantics of
``kvjax.reference.unified_attention``: decode batches through the decode kernel where the
format has Mosaic GPU hooks, everything else through the ragged kernel), the kernels'
own entries :func:`ragged_paged_attention` and :func:`paged_decode_attention`, and the
registry checks :func:`supports_attention` / :func:`prefer_attention` (None = yes, else a
one-line reason). Importing this package does not import Mosaic GPU; the kernel modules are
loaded on the first call. docs/mosaic_gpu.md has the design.
"""
from pallas_kernels.mosaic_gpu.attention import (prefer_attention, supports_attention,
                                                 unified_attention)
from pallas_kernels.mosaic_gpu.decode import paged_decode_attention
from pallas_kernels.mosaic_gpu.ragged_attention import ragged_paged_attention

__all__ = ["unified_attention", "ragged_paged_attention", "paged_decode_attention",
           "supports_attention", "prefer_attention"]
