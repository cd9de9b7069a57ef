"""The codec interface: what one kind of cache format decides, in one object.

A codec owns, for its format kind:

- the format's facts: storage dtype, layouts it allows, which scales take part;
- the geometry: row widths (data and padded), the logical shape, the checks on head size;
- the frame its values are stored in: ``rotation``, a :class:`kvjax.rotation.Rotation` of
  the head dim (the identity but for int4 per token-head, which stores vLLM's
  Hadamard-rotated rows); the public ops apply it around every implementation;
- the reference (pure jnp) encode / scatter / dequantize that ``kvjax.reference`` runs, on
  values in the stored frame.

A codec names no kernel backend: each backend matches codecs by these facts in its own
adapter table (:mod:`kvjax.adapters`), so a new format whose facts a backend already
understands runs there with no backend code.

Row formats (every kind but nvfp4) store one row of ``C`` elements per (token, head),
``[K data | K scale | V data | V scale]`` with the scale parts empty when the format has no
per-row scales; :class:`Codec` implements their reference write and views once, and a
row format only says how a side is encoded and decoded. A new kind is one subclass (one
file) plus one row in :data:`kvjax.formats.CACHE_FORMATS`.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from kvjax import quant
from kvjax.codecs.address import RowAddress
from kvjax.rotation import NO_ROTATION, Rotation


@dataclasses.dataclass(frozen=True)
class Codec:
  """One kind of cache format (subclasses: one per kind), with its parameters.

  Attributes:
    storage: numpy dtype of the cache array; None = the model dtype.
    quant: what values are quantized to (e.g. int8, e4m3, "int4", "e2m1"); None when not.
    qmax: largest magnitude the quantized values hold (per-token-head formats).
  """
  storage: Optional[np.dtype] = None
  quant: object = None
  qmax: Optional[float] = None

  #: Name of the kind (``CacheFormat.kind``).
  kind: ClassVar[str] = ""
  #: Layouts the format can be stored in.
  layouts: ClassVar[Tuple[str, ...]] = ("NHD", "HND")
  #: Whether k_scale / v_scale (global scales) take part; whether they may be ``[H]``.
  has_tensor_scales: ClassVar[bool] = False
  per_head_tensor_scales: ClassVar[bool] = False
  #: Whether each side row ends in a float32 scale (per-token-head formats).
  has_row_scales: ClassVar[bool] = False
  #: Whether K and V are the two halves of a row (False: nvfp4's head groups).
  content_halves: ClassVar[bool] = True
  #: Why a layered (cross-layer) array cannot hold the format; None = it can (every row
  #: format: a row is self-contained, wherever the layer's pages sit).
  no_layered_reason: ClassVar[Optional[str]] = None
  #: The head-dim rotation of the stored values (``kvjax.write_kv`` rotates K/V before any
  #: implementation encodes them; attention and reads rotate q and un-rotate results).
  rotation: ClassVar[Rotation] = NO_ROTATION

  # -- facts and geometry ------------------------------------------------------------------------
  @property
  def is_quantized(self) -> bool:
    return self.quant is not None

  @property
  def is_plain(self) -> bool:
    """Whether values are stored as they are (cast to the storage dtype), with no scale of
    any kind: a kernel for plain caches reads the pages directly."""
    return self.quant is None and not self.has_tensor_scales and not self.has_row_scales

  def tensor_scales(self, k_scale, v_scale, num_heads: int):
    """float32 ``[2, H]``: the K and V global scale of each KV head, ones when the format
    has none (vLLM passes scales to every backend; kernels multiply by them blindly)."""
    used = self.has_tensor_scales
    return jnp.stack([quant.per_head_scales(s if used else None, num_heads)
                      for s in (k_scale, v_scale)])

  def storage_dtype(self, model_dtype) -> np.dtype:
    return np.dtype(model_dtype) if self.storage is None else self.storage

  def check_head_size(self, head_size: int):
    """Raise ValueError when ``head_size`` does not fit the format."""

  def data_dim(self, head_size: int) -> int:
    """Storage elements of data in one side row."""
    return head_size

  def padded_dim(self, head_size: int, itemsize: int) -> int:
    """Storage elements of one side row, its scale slot included (``padded_hs``)."""
    return self.data_dim(head_size) + (4 // itemsize if self.has_row_scales else 0)

  def logical_shape(self, num_blocks, num_kv_heads, block_size, head_size, itemsize):
    """vLLM's logical cache shape ``(B, H, N, C)``."""
    return (num_blocks, num_kv_heads, block_size, 2 * self.padded_dim(head_size, itemsize))

  def head_segments(self, spec) -> Tuple[int, ...]:
    """Bytes one KV head holds in each segment of an HND page, in page order. A page is its
    segments one after the other, each holding every head's part in head order: one segment
    of ``N`` whole rows a head for row formats (what a transfer that slices heads reads)."""
    return (spec.block_size * spec.content_dim * spec.itemsize,)

  def scale_shape(self, num_heads: int) -> Tuple[Tuple[int, ...], ...]:
    """Shapes k_scale / v_scale may take (when :attr:`has_tensor_scales`)."""
    return ((),) + (((num_heads,),) if self.per_head_tensor_scales else ())

  # -- reference: encode a side, decode a side (row formats) -------------------------------------
  def encode_side(self, x, global_scale, spec):
    """``x [T, H, D]`` -> its side rows ``[T, H, padded]`` in the storage dtype."""
    raise NotImplementedError

  def decode_side(self, rows, global_scale, spec):
    """Side rows ``[P..., N, H, padded]`` -> float32 values ``[P..., N, H, D]``."""
    raise NotImplementedError

  # -- reference: whole rows, writes, pages ------------------------------------------------------
  def encode(self, key, value, spec, k_scale=None, v_scale=None):
    """New tokens ``[T, H, D]`` -> the content rows ``[T, H, C]`` the cache stores."""
    return jnp.concatenate([self.encode_side(key, k_scale, spec),
                            self.encode_side(value, v_scale, spec)], axis=-1)

  def scatter(self, cache, encoded, block, token, spec):
    """Store encoded rows at (block, token); ids ``>= B`` are dropped. Moves bits, never
    floats (:func:`kvjax.quant.to_bits`)."""
    bits = quant.to_bits(cache).at[RowAddress.of(spec).rows_at(block, token)].set(
        quant.to_bits(encoded), mode="drop")
    return quant.from_bits(bits, cache.dtype)

  def sides(self, pages, spec):
    """(K rows, V rows) token-major ``[P..., N, H, padded]`` of physical pages."""
    rows = RowAddress.of(spec).token_major(pages)
    w = spec.padded_head_size
    return rows[..., :w], rows[..., w:]

  def dequantize(self, pages, spec, k_scale=None, v_scale=None):
    """Dequantized (K, V), float32 ``[P..., N, H, D]``, of physical pages ``[P..., *page]``."""
    k_rows, v_rows = self.sides(pages, spec)
    return self.decode_side(k_rows, k_scale, spec), self.decode_side(v_rows, v_scale, spec)

  def row_scales(self, rows, spec):
    """float32 ``[...]`` per-row scales stored after the data of side rows ``[..., padded]``."""
    if not self.has_row_scales:
      raise ValueError(f"cache_dtype={spec.cache_dtype!r} has no per-token-head scales")
    return quant.scale_from_storage(rows[..., spec.data_dim:])
