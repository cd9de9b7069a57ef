"""Mosaic TPU (Pallas TPU) kernels for the packed paged KV cache.

Entry points (inputs validated by the public ops ``kvjax.write_kv`` and
``kvjax.unified_attention``): :func:`write_kv`, :func:`ragged_paged_attention`, and the
registry checks :func:`supports_write` / :func:`supports_attention`. ``interpret=True``
runs them on CPU in TPU interpret mode; ``interpret=False`` compiles them for a TPU.
See docs/tpu.md for the tiling and DMA plan.
"""
from pallas_kernels.mosaic_tpu.cache_update import supports_write, write_kv
from pallas_kernels.mosaic_tpu.codec import SUPPORTED_CACHE_DTYPES

__all__ = ["write_kv", "supports_write", "SUPPORTED_CACHE_DTYPES"]
