"""Per-cache-format tile math of the decode kernel: where a token's bytes are, how to score them.

The kernel sees each page of the physical cache as one flat row
(``cache.reshape(B, page_elems)``, free for a contiguous array), so NHD and
HND differ only in two strides:

  NHD (B, N, H, C): element (t, h, c) of a page at ``t*H*C + h*C + c``
  HND (B, H, N, C): at ``h*N*C + t*C + c``

nvfp4 (HND only) pages hold, per side, ``[data (H, N, D/2) | scales (H, N, D/16)]``,
K side first (spec §1, §5).

A :class:`TileFormat` is static (hashable) and offers two in-kernel functions:
``scores(...)`` -> float32 ``[Gp, T]`` of ``q . k`` (no softmax scale), and
``values(...)`` -> a tuple of float32 ``[Gp, X]`` accumulator parts of ``p @ v``.
Split formats (int4, nvfp4) keep even and odd head dims apart: q arrives as
``[q_even | q_odd]`` and the output parts are (even, odd), interleaved outside.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton

from kvjax import formats as F
from kvjax.spec import KVCacheSpec

_HIGHEST = lax.Precision.HIGHEST


def next_pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def _exact_in(cdt, spec: KVCacheSpec) -> bool:
  """Whether every dequantized cache element (before scales) is exact in ``cdt``."""
  fmt = spec.format
  if fmt.kind == F.PLAIN:
    return spec.storage_dtype == np.dtype(cdt)
  return True  # fp8, int8, int4 codes and e2m1 x e4m3 all fit bf16 and f16 exactly


@dataclasses.dataclass(frozen=True)
class TileFormat:
  """Static geometry of one cache format for the decode kernel.

  Attributes:
    kind: format kind (kvjax.formats PLAIN, FP8_PER_TENSOR, PER_TOKEN_HEAD, NVFP4).
    quant: the format's quant (None, fp8 dtype, int8, "int4", "e2m1").
    num_heads, block_size, head_size: H, N, D.
    stride_token, stride_head: element strides of a token / head inside a page row.
    v_offset: element offset of V's data from K's data in a (token, head) row.
    data_dim: stored elements of data per side row (D, or D/2).
    data_pad: data_dim padded to a power of two (>= 16).
    page_elems: elements of one page.
    compute_dtype: dtype the dots run in (q's dtype, or float32).
    split: whether q / outputs come as even/odd halves (int4, nvfp4).
  """
  kind: str
  quant: object
  num_heads: int
  block_size: int
  head_size: int
  stride_token: int
  stride_head: int
  v_offset: int
  data_dim: int
  data_pad: int
  page_elems: int
  compute_dtype: object
  split: bool

  @staticmethod
  def of(spec: KVCacheSpec, q_dtype) -> "TileFormat":
    fmt = spec.format
    h, n = spec.num_kv_heads, spec.block_size
    c = spec.content_dim
    if spec.layout == "NHD":
      s_tok, s_head = h * c, c
    else:
      s_tok, s_head = c, n * c
    if fmt.kind == F.NVFP4:
      s_tok, s_head = spec.data_dim, n * spec.data_dim  # within one side's data block
    q_dtype = np.dtype(q_dtype)
    cdt = q_dtype if q_dtype in (np.dtype(jnp.bfloat16), np.dtype(np.float16)) else np.dtype(
        np.float32)
    if not _exact_in(cdt, spec):
      cdt = np.dtype(np.float32)
    split = fmt.kind == F.NVFP4 or (fmt.kind == F.PER_TOKEN_HEAD and fmt.quant == "int4")
    page = int(np.prod(spec.physical_shape(1)[1:]))
    return TileFormat(kind=fmt.kind, quant=fmt.quant, num_heads=h, block_size=n,
                      head_size=spec.head_size, stride_token=s_tok, stride_head=s_head,
                      v_offset=spec.padded_head_size, data_dim=spec.data_dim,
                      data_pad=max(16, next_pow2(spec.data_dim)), page_elems=page,
                      compute_dtype=cdt, split=split)

  # -- static facts -------------------------------------------------------------------------
  @property
  def num_parts(self) -> int:
    return 2 if self.split else 1

  @property
  def part_width(self) -> int:
    """Width of one q / accumulator part: data_pad (split halves are D/2 wide)."""
    return self.data_pad

  @property
  def precision(self):
    return _HIGHEST if self.compute_dtype == np.dtype(np.float32) else None

  # -- in-kernel helpers --------------------------------------------------------------------
  def _dot(self, a, b, trans_b=False):
    """float32 ``a @ b`` (``a @ b.T`` with trans_b) in the compute dtype.

    lax.dot_general, not ``pl.dot``: that raises AttributeError on jax 0.11.2 (GPU machine).
    """
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a.astype(self.compute_dtype), b.astype(self.compute_dtype), dims,
                           precision=self.precision, preferred_element_type=jnp.float32)

  def _cols(self):
    cols = jnp.arange(self.data_pad, dtype=jnp.int32)
    return cols, cols < self.data_dim

  @staticmethod
  def _gather(cache_ref, blk, offs, mask, other=0):
    """cache[blk[t], offs[t, x]] for ``blk [T]``, ``offs [T, X]`` -> ``[T, X]`` (masked)."""
    idx = (jnp.broadcast_to(blk[:, None], offs.shape), offs)
    if jnp.issubdtype(cache_ref.dtype, jnp.floating):
      other = float(other)  # Triton casts float fills to fp8, not int ones
    return pltriton.load(cache_ref.at[idx], mask=mask, other=other)

  @staticmethod
  def _gather_f32(cache_ref, blk, offs, mask):
    """The float32 held little-endian in 4 one-byte elements at ``offs [T]`` -> ``[T]``."""
    bits = jnp.zeros(offs.shape, jnp.int32)
    for i in range(4):
      b = pltriton.load(cache_ref.at[(blk, offs + i)], mask=mask, other=0)
      bits = bits | ((b.astype(jnp.int32) & 0xFF) << (8 * i))
    return lax.bitcast_convert_type(bits, jnp.float32)

  def row_base(self, tok_in_page, head):
    """Element offset of (token, head)'s row inside a page (non-nvfp4), int32 ``[T]``."""
    return tok_in_page * self.stride_token + head * self.stride_head

  def load_kv(self, cache_ref, blk, tok_in_page, head, valid):
    """Raw K and V tiles of one step (what the prefetching loop carries).

    Returns a tuple of arrays; consumed by :meth:`scores` and :meth:`values`.
    """
    cols, cmask = self._cols()
    mask = valid[:, None] & cmask[None, :]
    if self.kind == F.NVFP4:
      return self._load_nvfp4(cache_ref, blk, tok_in_page, head, valid)
    base = self.row_base(tok_in_page, head)
    k = self._gather(cache_ref, blk, base[:, None] + cols[None, :], mask)
    v = self._gather(cache_ref, blk, base[:, None] + (cols + self.v_offset)[None, :], mask)
    if self.kind != F.PER_TOKEN_HEAD:
      return (k, v)
    ks = self._gather_f32(cache_ref, blk, base + self.data_dim, valid)
    vs = self._gather_f32(cache_ref, blk, base + self.v_offset + self.data_dim, valid)
    return (k, v, ks, vs)

  def _load_nvfp4(self, cache_ref, blk, tok, head, valid):
    h, n, dh = self.num_heads, self.block_size, self.data_dim
    s_ = self.head_size // 16
    side = self.page_elems // 2
    cols, cmask = self._cols()
    mask = valid[:, None] & cmask[None, :]
    data = head * n * dh + tok * dh                     # [T]
    grp = cols // 8                                      # lo and hi nibbles of byte i: group i // 8
    k_sc = h * n * dh + head * n * s_ + tok[:, None] * s_ + grp[None, :]
    if s_ % 4 == 0:
      q4 = s_ // 4
      t2, g2 = tok[:, None], grp[None, :]
      v_pos = ((t2 // 4) * 4 + g2 // q4) * s_ + (g2 % q4) * 4 + t2 % 4
    else:
      v_pos = tok[:, None] * s_ + grp[None, :]
    v_sc = side + h * n * dh + head * n * s_ + v_pos
    kd = self._gather(cache_ref, blk, data[:, None] + cols[None, :], mask)
    vd = self._gather(cache_ref, blk, (side + data)[:, None] + cols[None, :], mask)
    ksf = self._gather(cache_ref, blk, k_sc, mask)
    vsf = self._gather(cache_ref, blk, v_sc, mask)
    return (kd, vd, ksf, vsf)

  # -- dequantization to what the dots take -------------------------------------------------
  def _to_values(self, x):
    """Plain / fp8 / int8 / fp8-per-token-head data tile -> compute dtype (unscaled)."""
    if x.dtype == np.dtype(np.uint8):   # fp8_per_token_head stores e4m3 as bytes
      x = lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
    if x.dtype == np.dtype(np.int8):
      x = x.astype(jnp.float32)
    return x.astype(self.compute_dtype)

  @staticmethod
  def _nibbles(x):
    """uint8 tile -> (low nibbles, high nibbles) as int32 codes in [0, 15]."""
    xi = x.astype(jnp.int32) & 0xFF
    return xi & 0xF, xi >> 4

  @staticmethod
  def _e2m1(code):
    """int32 e2m1 codes -> float32 values {0, .5, 1, 1.5, 2, 3, 4, 6} with sign."""
    e = (code >> 1) & 3
    m = (code & 1).astype(jnp.float32)
    pow2 = jnp.where(e == 3, 4.0, jnp.where(e == 2, 2.0, 1.0))
    mag = jnp.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    return jnp.where((code & 8) != 0, -mag, mag)

  @staticmethod
  def _int4_scale(raw):
    """int4 row scale float32 (zp in its low 4 mantissa bits) -> (scale, zp) float32."""
    bits = lax.bitcast_convert_type(raw, jnp.int32)
    zp = (bits & 0xF).astype(jnp.float32)
    scale = lax.bitcast_convert_type(bits & ~0xF, jnp.float32)
    return scale, zp

  def scores(self, q_parts, qsum, tiles, k_scale):
    """float32 ``[Gp, T]`` of q . k for one step (k dequantized, no softmax scale)."""
    if self.kind in (F.PLAIN, F.FP8_PER_TENSOR):
      s = self._dot(q_parts[0], self._to_values(tiles[0]), trans_b=True)
      return s if self.kind == F.PLAIN else s * k_scale
    if self.kind == F.NVFP4:
      kd, _, ksf, _ = tiles
      sf = lax.bitcast_convert_type(ksf, jnp.float8_e4m3fn).astype(jnp.float32)
      lo, hi = self._nibbles(kd)
      s = (self._dot(q_parts[0], self._e2m1(lo) * sf, trans_b=True)
           + self._dot(q_parts[1], self._e2m1(hi) * sf, trans_b=True))
      return s * k_scale
    k, _, ks, _ = tiles
    if self.quant == "int4":
      scale, zp = self._int4_scale(ks)
      lo, hi = self._nibbles(k)
      s = (self._dot(q_parts[0], lo.astype(jnp.float32), trans_b=True)
           + self._dot(q_parts[1], hi.astype(jnp.float32), trans_b=True))
      return (s - qsum[:, None] * zp[None, :]) * scale[None, :]
    return self._dot(q_parts[0], self._to_values(k), trans_b=True) * ks[None, :]

  def values(self, p, tiles, v_scale):
    """Accumulator parts (float32 ``[Gp, data_pad]`` each) of p @ v for one step."""
    if self.kind in (F.PLAIN, F.FP8_PER_TENSOR):
      o = self._dot(p, self._to_values(tiles[1]))
      return (o if self.kind == F.PLAIN else o * v_scale,)
    if self.kind == F.NVFP4:
      _, vd, _, vsf = tiles
      sf = lax.bitcast_convert_type(vsf, jnp.float8_e4m3fn).astype(jnp.float32)
      lo, hi = self._nibbles(vd)
      return (self._dot(p, self._e2m1(lo) * sf) * v_scale,
              self._dot(p, self._e2m1(hi) * sf) * v_scale)
    _, v, _, vs = tiles
    if self.quant == "int4":
      scale, zp = self._int4_scale(vs)
      w = (p * scale[None, :]).astype(self.compute_dtype).astype(jnp.float32)
      corr = jnp.sum(w * zp[None, :], axis=1)[:, None]
      lo, hi = self._nibbles(v)
      return (self._dot(w, lo.astype(jnp.float32)) - corr,
              self._dot(w, hi.astype(jnp.float32)) - corr)
    return (self._dot(p * vs[None, :], self._to_values(v)),)
