"""The Mosaic TPU backend's adapter table: which row hooks (:mod:`.rows`) read a codec.

Rows match a codec's facts (:mod:`kvjax.adapters`): plain rows, fp8 rows with per-tensor
scales, int8 / fp8 rows with a float32 scale a row, and int4 rows (two values a byte, a scale
and zero point a row). nvfp4 (whose sides are ``[data | block scales]`` splits of a page, not
rows) has none: the attention kernel reads it through a plain copy of the batch's pages
(:func:`.ragged_attention.reads_a_plain_copy`) and its write is XLA's.
"""
from __future__ import annotations

from kvjax import formats as F
from kvjax.adapters import Adapter, AdapterTable, packs, stores_fp8
from kvjax.spec import KVCacheSpec
from pallas_kernels.mosaic_tpu.rows import Fp8Rows, Int4Rows, PlainRows, RowScaledRows, Rows

ADAPTERS = AdapterTable("Mosaic TPU", (
    Adapter("plain rows", lambda c: c.content_halves and c.is_plain, PlainRows),
    Adapter("fp8 rows with per-tensor scales",
            lambda c: (c.content_halves and c.has_tensor_scales and not c.has_row_scales
                       and stores_fp8(c)), Fp8Rows),
    Adapter("int8 / fp8 rows with a float32 scale a row",
            lambda c: c.content_halves and c.has_row_scales and not packs(c, "int4"),
            RowScaledRows),
    Adapter("int4 rows: two values a byte, a float32 scale with its zero point a row",
            lambda c: c.content_halves and c.has_row_scales and packs(c, "int4"), Int4Rows),
))

#: Cache dtypes of the built-in table both kernels handle.
SUPPORTED_CACHE_DTYPES = tuple(name for name, fmt in F.CACHE_FORMATS.items()
                               if ADAPTERS.row(fmt.codec) is not None)
#: Query (model) dtypes the attention kernel takes.
SUPPORTED_Q_DTYPES = F.MODEL_DTYPES


def unsupported_reason(spec) -> str | None:
  """None when the kernels handle ``spec``, else a one-line reason."""
  if not isinstance(spec, KVCacheSpec):
    return f"{type(spec).__name__}: the Mosaic TPU kernels take a KVCacheSpec"
  return ADAPTERS.reason(spec)


def rows_of(spec: KVCacheSpec) -> Rows:
  """The row hooks of ``spec``'s format."""
  return ADAPTERS.hooks(spec.codec).of(spec)
