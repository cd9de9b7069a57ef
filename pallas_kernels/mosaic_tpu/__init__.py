"""Mosaic TPU (Pallas TPU) kernels for the packed paged KV cache.

Entry points (inputs validated by the public ops ``kvjax.write_kv`` and
``kvjax.unified_attention``): :func:`write_kv`, :func:`ragged_paged_attention`, and the
registry checks :func:`supports_write` / :func:`supports_attention` (None = supported, else
a one-line reason). ``interpret=True`` runs the kernels on CPU in TPU interpret mode;
``interpret=False`` compiles them for a TPU. docs/tpu.md has the tiling and DMA plan.
"""
from pallas_kernels.mosaic_tpu.cache_update import supports_write, write_kv
from pallas_kernels.mosaic_tpu.adapters import SUPPORTED_CACHE_DTYPES, SUPPORTED_Q_DTYPES
from pallas_kernels.mosaic_tpu.ragged_attention import (prefer_attention, ragged_paged_attention,
                                                        supports_attention)

__all__ = ["write_kv", "ragged_paged_attention", "supports_write", "supports_attention",
           "prefer_attention",
           "SUPPORTED_CACHE_DTYPES", "SUPPORTED_Q_DTYPES"]
