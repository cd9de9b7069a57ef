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
from pallas_kernels.mosaic_gpu import nibbles
from pallas_kernels.mosaic_gpu.formats import Fp8Operands, even_odd, from_even_odd

#: Bytes a side row's copy moves besides its data: up to 12 before it (from the 16-byte
#: boundary), its scale and the rest, in all a multiple of 16 as TMA wants. Rows of
#: ``data + 16`` bytes in shared memory are 16 bytes apart mod 128, so the 8 rows a warp's
#: 4-byte loads reach fall on different banks.
SCALE_BOX = 16
#: Largest landing row: a TMA box is at most 256 elements wide.
MAX_BOX = 256


def code_compute(spec, q_dtype) -> np.dtype:
  """The wgmma operand dtype of a row-scaled format: int8 codes read with bfloat16 queries
  compute in bfloat16, where Mosaic GPU turns signed bytes into values with byte permutes and
  one bfloat16x2 subtraction per two values (to float16 it takes one conversion per value, at
  a quarter of the ALU rate); every code is exact in both. Otherwise (int4 codes convert to
  float16 by byte permutes, :mod:`.nibbles`) the rule of every GPU kernel
  (:func:`pallas_kernels.common.compute_dtype`)."""
  quant = spec.codec.quant
  int8 = not isinstance(quant, str) and np.dtype(quant).kind in "iu"
  if int8 and np.dtype(q_dtype) == np.dtype(jnp.bfloat16):
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
  ragged_direct: ClassVar[bool] = False    # rows off 16-byte boundaries: a plain copy
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
    reduction), each byte loaded from its column and put in place."""
    lax, _, plgpu, load_whole = _mgpu()
    first = rows_ref.shape[1] - 4
    word = None
    for j in range(4):
      col = load_whole(rows_ref.at[:, first + j], layout=plgpu.Layout.WGMMA.reduce(1),
                       optimized=False)
      byte = col.astype(jnp.int32) & 0xFF       # the byte, whether int8 or uint8 is stored
      word = byte if word is None else word | lax.shift_left(byte, 8 * j)
    return word

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

  The kernel computes in float16 in the order ``[even dims | odd dims]`` (:meth:`output` puts
  the dims back). A byte's nibbles come out without a shift: the low one as ``n``, the high
  one as ``16 n`` (compiled: byte permutes, :mod:`.nibbles`), both exact. So q's odd half
  comes divided by 16 (exact) and:

  * scores: ``s_t = scale_t (S_t - zp_t sum(q))``, ``sum(q)`` each query's sum (once a call:
    :meth:`q_sums`);
  * values: ``O^T`` loses ``sum_t zp_t w_t`` (a per-thread sum carried through the key loop)
    and its odd half is divided by 16.
  """
  num_q_sums: ClassVar[int] = 1
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
    """float32 ``[..., 1, Hq]``: each query's sum (of :meth:`q_operand`'s rows, the odd half
    times 16)."""
    x = q_op.astype(jnp.float32)
    half = x.shape[-1] // 2
    return (x[..., :half].sum(-1) + 16 * x[..., half:].sum(-1))[..., None, :]

  def output(self, out):
    return from_even_odd(out)

  def _codes(self, rows_ref):
    """A slot's ``(n_low, 16 n_high)``, float16 ``(T, D / 2)`` each in the WGMMA layout."""
    _, _, plgpu, load_whole = _mgpu()
    x = load_whole(self._data(rows_ref), layout=plgpu.Layout.WGMMA_UPCAST_2X)
    if self.ptx:
      return nibbles.to_f16_halves(x, nibbles.INT4_PTX)
    return tuple(plgpu.layout_cast((x & jnp.uint8(m)).astype(jnp.float16), plgpu.Layout.WGMMA)
                 for m in (0x0F, 0xF0))

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
    (q_sum,) = q_sums
    return (sc - rows(zero) * lax.broadcast_in_dim(q_sum, sc.shape, [1])) * rows(scale * factor)

  def value_state(self, shape):
    """``sum_t zp_t w_t`` per thread, float32 ``(T, 16)``."""
    _, _, plgpu, _ = _mgpu()
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

  def value_weights(self, p, slot_ref, visible, alpha, state):
    lax, _, _, _ = _mgpu()
    scale, zero = self._scale_and_zero(slot_ref)
    rows = lambda x: lax.broadcast_in_dim(x, p.shape, [0])
    w = jnp.where(visible, p * rows(scale), 0.0)
    w = w.astype(self.compute).astype(jnp.float32)     # as the V product reads them
    if alpha is not None:
      state = state * lax.broadcast_in_dim(alpha, p.shape, [1])
    return w, state + w * rows(zero)

  def finish_values(self, acc, state):
    lax, _, plgpu, _ = _mgpu()
    dims = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, acc.shape, 0), plgpu.Layout.WGMMA)
    odd = dims >= acc.shape[0] // 2
    zw = lax.broadcast_in_dim(state.sum(axis=0), acc.shape, [1])
    return jnp.where(odd, acc * (1 / 16), acc) - zw

  def prepare_v(self, slot_ref, v_ref, keep_row, commit):
    """V's codes into the V buffer as ``[low | high]`` halves (codes are finite: hidden keys
    need no zeroing, their weights are 0)."""
    _, pl, _, _ = _mgpu()
    lo, hi = self._codes(slot_ref)
    half = lo.shape[1]
    v_ref.at[:, pl.ds(0, half)][...] = lo
    v_ref.at[:, pl.ds(half, half)][...] = hi
    commit()
