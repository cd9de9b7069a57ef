"""Mosaic GPU hooks (:mod:`.formats`) of the formats with a float32 scale per (token, head)
side row: int8 / fp8 per token-head (:class:`RowScaledOperands`) and int4 per token-head
(:class:`Int4Operands`).

A side row ``[data | scale]`` sits 4, 8 or 12 bytes off a 16-byte boundary, and a TMA box
must start on one: each row lands untiled (no swizzle) from the boundary at or before it,
``data + SCALE_BOX`` bytes with its scale, and the kernel hands the hooks the slot's rows from
the data on, ``(T, data + 4)`` (:func:`.decode_kernel._landed`). The kernel copies from a
view of the cache whose rows are 16 bytes apart (:func:`.decode.cache_view`). Scales apply
once per key: the K scale to the key's score, the V scale to its softmax weight (0 for keys
the query does not see: stale scale bytes may be NaN).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import compute_dtype
from pallas_kernels.mosaic_gpu.formats import Fp8Operands, even_odd, from_even_odd

#: Bytes a side row's copy moves besides its data: up to 12 before it (from the 16-byte
#: boundary), its scale and the rest, in all a multiple of 16 as TMA wants. Rows of
#: ``data + 16`` bytes in shared memory are 16 bytes apart mod 128, so the 8 rows a warp's
#: 4-byte loads reach fall on different banks.
SCALE_BOX = 16
#: Largest landing row: a TMA box is at most 256 elements wide.
MAX_BOX = 256


def code_compute(spec, q_dtype) -> np.dtype:
  """The wgmma operand dtype of a row-scaled format: integer codes (int8, int4) read with
  bfloat16 queries compute in bfloat16, where Mosaic GPU turns signed bytes into values with
  byte permutes and one bfloat16x2 subtraction per two values (to float16 it takes one
  conversion per value, at a quarter of the ALU rate); every code the hooks convert is exact
  in both. Otherwise the rule of every GPU kernel (:func:`pallas_kernels.common.compute_dtype`).
  """
  quant = spec.codec.quant
  codes = quant == "int4" if isinstance(quant, str) else np.dtype(quant).kind in "iu"
  if codes and np.dtype(q_dtype) == np.dtype(jnp.bfloat16):
    return np.dtype(jnp.bfloat16)
  return compute_dtype(spec.codec, spec.storage_dtype, q_dtype)


def _mgpu():
  from jax import lax   # noqa: PLC0415
  from jax.experimental import pallas as pl   # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu   # noqa: PLC0415
  from pallas_kernels.mosaic_gpu.compat import load_whole   # noqa: PLC0415
  return lax, pl, plgpu, load_whole


@dataclasses.dataclass(frozen=True)
class RowScaledOperands(Fp8Operands):
  """int8 / fp8 values, each side row ending in its float32 scale.

  The stored bytes are the values' bits (``values``: int8, or e4m3 stored as uint8); they
  convert to :func:`code_compute`'s dtype (every value is exact in it).
  """
  row_scaled: ClassVar[bool] = True
  values: Optional[np.dtype] = None

  @classmethod
  def of(cls, spec, q_dtype) -> "RowScaledOperands":
    return cls(storage=np.dtype(spec.storage_dtype), compute=code_compute(spec, q_dtype),
               values=np.dtype(spec.codec.quant))

  @classmethod
  def reason(cls, spec, q_dtype) -> Optional[str]:
    why = super().reason(spec, q_dtype)
    if why is None and spec.data_dim + SCALE_BOX > MAX_BOX:
      why = (f"head_size={spec.head_size}: a side row lands as one TMA box of its "
             f"{spec.data_dim} data bytes + {SCALE_BOX} <= {MAX_BOX}")
    return why

  def data_cols(self, head_size: int) -> int:
    """Stored bytes of a side row's data."""
    return head_size

  def landing(self, stages: int, rows: int, cols: int, tiled, side: int = 0):
    from jax.experimental.pallas import mosaic_gpu as plgpu   # noqa: PLC0415
    return plgpu.SMEM((stages, rows, self.landing_cols(cols)), self.storage)

  def landing_cols(self, head_size: int) -> int:
    return self.data_cols(head_size) + SCALE_BOX

  @staticmethod
  def _data(rows_ref):
    """The ``(T, data)`` bytes of a slot's rows (the scale's 4 bytes follow them)."""
    _, pl, _, _ = _mgpu()
    return rows_ref.at[:, pl.ds(0, rows_ref.shape[1] - 4)]

  def _convert(self, rows_ref):
    lax, _, plgpu, load_whole = _mgpu()
    x = load_whole(self._data(rows_ref), layout=plgpu.Layout.WGMMA_UPCAST_2X)
    if x.dtype != self.values:
      x = lax.bitcast_convert_type(x, self.values)
    return plgpu.layout_cast(x.astype(self.compute), plgpu.Layout.WGMMA)

  def k_operand(self, slot_ref):
    return self._convert(slot_ref)

  def v_values(self, slot_ref):
    return self._convert(slot_ref)

  @staticmethod
  def row_words(rows_ref):
    """int32 ``(T,)``: the 4 bytes of each key's scale (the layout of a WGMMA row
    reduction). The 16 bytes ending in each row's scale go to registers; each thread puts
    its bytes of the scale in place and the row's four are summed (disjoint bits)."""
    lax, pl, plgpu, load_whole = _mgpu()
    layout = plgpu.Layout.WGMMA
    window = rows_ref.at[:, pl.ds(rows_ref.shape[1] - 16, 16)]
    raw = load_whole(window, layout=layout, optimized=False)
    byte = raw.astype(jnp.int32) & 0xFF       # the byte, whether int8 or uint8 is stored
    cols = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (rows_ref.shape[0], 16), 1),
                             layout)
    word = jnp.where(cols >= 12, lax.shift_left(byte, jnp.maximum(cols - 12, 0) * 8), 0)
    return word.sum(axis=1)

  def row_scales(self, rows_ref):
    """float32 ``(T,)`` scale of each key of a slot (WGMMA row-reduction layout)."""
    lax, _, _, _ = _mgpu()
    return lax.bitcast_convert_type(self.row_words(rows_ref), jnp.float32)

  def scale_scores(self, sc, slot_ref, factor, q_sums):
    lax, _, _, _ = _mgpu()
    scale = self.row_scales(slot_ref) * factor
    return sc * lax.broadcast_in_dim(scale, sc.shape, [0])

  def value_weights(self, p, slot_ref, visible, alpha, state):
    lax, _, _, _ = _mgpu()
    scale = lax.broadcast_in_dim(self.row_scales(slot_ref), p.shape, [0])
    return jnp.where(visible, p * scale, 0.0), state


@dataclasses.dataclass(frozen=True)
class Int4Operands(RowScaledOperands):
  """int4 codes two a byte (low nibble: the even element), each side row ending in its
  scale with the zero point in its 4 low bits: value = ``(code - zp) * scale``.

  The kernel computes in the order ``[even dims | odd dims]`` (:meth:`output` puts the dims
  back). A byte's nibbles come out as signed bytes with one mask each and no shift (8-bit
  registers take none): the low nibble as ``n``, the high one as ``16 n - 128`` (its top bit
  flipped), both exact in the compute dtype and converted by :func:`code_compute`'s fast
  path. So q's odd half comes divided by 16 (exact) and:

  * scores: ``s_t = scale_t (S_t + c - zp_t sum(q))``, ``c = 8 sum(q_odd)`` and ``sum(q)``
    the query's sums (once a call: :meth:`q_sums`);
  * values: the even half of ``O^T`` loses ``sum_t zp_t w_t``, the odd half is divided by 16
    and loses ``sum_t (zp_t - 8) w_t`` (per-thread sums carried through the key loop).
  """
  num_q_sums: ClassVar[int] = 2
  reorders_dims: ClassVar[bool] = True

  @classmethod
  def of(cls, spec, q_dtype) -> "Int4Operands":
    return cls(storage=np.dtype(spec.storage_dtype), compute=code_compute(spec, q_dtype),
               values=np.dtype(np.uint8))

  def data_cols(self, head_size: int) -> int:
    return head_size // 2

  def q_swizzle(self, head_size: int) -> Optional[int]:
    return min(128, head_size * self.compute.itemsize // 2)   # a half's rows, up to 128

  def q_operand(self, q):
    """q ``[..., D]`` as the kernel reads it: ``[even dims | odd dims / 16]``, compute dtype."""
    return even_odd(super().q_operand(q), 1 / 16)

  def q_sums(self, q_op):
    """float32 ``[..., 2, Hq]``: of each query (:meth:`q_operand`'s rows), its sum and the
    score's offset ``c`` (``8 sum(q_odd)``: the high nibbles read as ``16 n - 128``)."""
    x = q_op.astype(jnp.float32)
    half = x.shape[-1] // 2
    odd = x[..., half:].sum(-1)
    return jnp.stack([x[..., :half].sum(-1) + 16 * odd, 128 * odd], axis=-2)

  def output(self, out):
    return from_even_odd(out)

  def _codes(self, rows_ref):
    """A slot's ``(n_low, 16 n_high - 128)``, ``(T, D / 2)`` each in the compute dtype."""
    _, _, plgpu, load_whole = _mgpu()
    x = load_whole(self._data(rows_ref), layout=plgpu.Layout.WGMMA_UPCAST_2X)
    halves = (x & jnp.uint8(0x0F), (x & jnp.uint8(0xF0)) ^ jnp.uint8(0x80))
    # uint8 -> int8 relabels the bytes (0..15, and 16 n - 128 wrapped): a bitcast would not
    # (Mosaic GPU keeps a bitcast's source signedness between int8 and uint8).
    return tuple(plgpu.layout_cast(h.astype(jnp.int8).astype(self.compute),
                                   plgpu.Layout.WGMMA) for h in halves)

  def score_operands(self, slot_ref, q_smem):
    _, pl, _, _ = _mgpu()
    lo, hi = self._codes(slot_ref)
    half = lo.shape[1]
    return ((lo, q_smem.at[:, pl.ds(0, half)].transpose((1, 0))),
            (hi, q_smem.at[:, pl.ds(half, half)].transpose((1, 0))))

  def _scale_and_zero(self, rows_ref):
    lax, _, _, _ = _mgpu()
    bits = self.row_words(rows_ref)
    scale = lax.bitcast_convert_type(bits & ~15, jnp.float32)
    return scale, (bits & 15).astype(jnp.float32)

  def scale_scores(self, sc, slot_ref, factor, q_sums):
    lax, _, _, _ = _mgpu()
    scale, zero = self._scale_and_zero(slot_ref)
    rows = lambda x: lax.broadcast_in_dim(x, sc.shape, [0])
    cols = lambda x: lax.broadcast_in_dim(x, sc.shape, [1])
    q_sum, offset = q_sums
    return (sc + cols(offset) - rows(zero) * cols(q_sum)) * rows(scale * factor)

  def value_state(self, shape):
    """``(sum_t zp_t w_t, sum_t w_t)`` per thread, float32 ``(T, 16)`` each."""
    _, _, plgpu, _ = _mgpu()
    zeros = lambda: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    return zeros(), zeros()

  def value_weights(self, p, slot_ref, visible, alpha, state):
    lax, _, _, _ = _mgpu()
    scale, zero = self._scale_and_zero(slot_ref)
    rows = lambda x: lax.broadcast_in_dim(x, p.shape, [0])
    w = jnp.where(visible, p * rows(scale), 0.0)
    w = w.astype(self.compute).astype(jnp.float32)     # as the V product reads them
    zw, ws = state
    if alpha is not None:
      a = lax.broadcast_in_dim(alpha, p.shape, [1])
      zw, ws = zw * a, ws * a
    return w, (zw + w * rows(zero), ws + w)

  def finish_values(self, acc, state):
    lax, _, plgpu, _ = _mgpu()
    dims = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, acc.shape, 0), plgpu.Layout.WGMMA)
    odd = dims >= acc.shape[0] // 2
    zw, ws = (lax.broadcast_in_dim(x.sum(axis=0), acc.shape, [1]) for x in state)
    return jnp.where(odd, acc * (1 / 16) + 8 * ws, acc) - zw

  def prepare_v(self, slot_ref, v_ref, keep_row, commit):
    """V's codes into the V buffer as ``[low | high]`` halves (codes are finite: hidden keys
    need no zeroing, their weights are 0)."""
    _, pl, _, _ = _mgpu()
    lo, hi = self._codes(slot_ref)
    half = lo.shape[1]
    v_ref.at[:, pl.ds(0, half)][...] = lo
    v_ref.at[:, pl.ds(half, half)][...] = hi
    commit()
