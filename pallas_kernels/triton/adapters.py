"""The Triton backend's adapter table: which hook class (:mod:`.formats`) reads each codec.

Rows match a codec's facts (:mod:`kvjax.adapters`): formats whose K and V are head groups
of ``[data | scales]`` sides (nvfp4), rows of int4 codes (two a byte, a scale and a zero
point a row), and every other row format ``[K data | K scale | V data | V scale]`` (plain,
fp8 per tensor, int8 / fp8 per token-head, and any new row format: its codec's facts say
which scales apply).
"""
from __future__ import annotations

import numpy as np

from kvjax.adapters import Adapter, AdapterTable, packs
from pallas_kernels.common import compute_dtype, next_pow2
from pallas_kernels.triton.formats import Int4Format, Nvfp4Format, RowFormat, TileFormat

ADAPTERS = AdapterTable("Triton", (
    Adapter("head-group sides of e2m1 codes (nvfp4)",
            lambda c: not c.content_halves and packs(c, "e2m1"), Nvfp4Format),
    Adapter("rows of int4 codes with a scale and zero point",
            lambda c: c.content_halves and c.has_row_scales and packs(c, "int4"), Int4Format),
    Adapter("rows [K data | K scale | V data | V scale]",
            lambda c: c.content_halves and not packs(c, "int4"), RowFormat),
))


def hooks_reason(spec):
  """Registry supports-hook: None when the Triton kernels can run ``spec``'s format."""
  return ADAPTERS.reason(spec)


def tile_format(spec, q_dtype=None) -> TileFormat:
  """The hooks of ``spec``'s format for queries of ``q_dtype`` (None: float32 dots)."""
  cls = ADAPTERS.hooks(spec.codec)
  if cls is None:
    raise ValueError(ADAPTERS.reason(spec))
  cdt = compute_dtype(spec.codec, spec.storage_dtype, np.float32 if q_dtype is None else q_dtype)
  return cls(codec=spec.codec, storage=spec.storage_dtype, num_heads=spec.num_kv_heads,
             block_size=spec.block_size, head_size=spec.head_size,
             addr=cls.address(spec), v_offset=spec.padded_head_size,
             data_dim=spec.data_dim, data_pad=max(16, next_pow2(spec.data_dim)),
             page_elems=int(np.prod(spec.physical_shape(1)[1:])), compute_dtype=cdt)
