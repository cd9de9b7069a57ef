"""Bytes of two 4-bit codes -> float16 in compiled Mosaic GPU kernels, by byte permutes.

A register of two code bytes ``b0 b1`` becomes a float16x2 of their low nibbles and one of
their high nibbles in a few integer instructions of inline PTX (Mosaic GPU's interpret mode
runs none: the hooks compute the same values with array operations there). Each snippet is
exact for every code; tests/test_pairs.py runs them on every byte pair through a model of
their instructions.

* e2m1 (:data:`E2M1_PTX`, 9 instructions): every e2m1 magnitude is a float16 whose low byte is
  zero (0, 0.5, 1, 1.5, 2, 3, 4, 6 are ``0x0000, 0x3800, ..., 0x4600``), so the 8 high bytes
  fit two 32-bit registers and one ``prmt`` looks up two codes at once: its selector's
  nibbles 1 and 3 hold the two codes' magnitude bits (nibbles 0 and 2 pick the table's zero
  byte). A second ``prmt`` moves the two codes' sign bits under bits 15 and 31, and one
  ``lop3`` merges them in (-0 included).
* int4 (:data:`INT4_PTX`, 5 instructions): one ``prmt`` puts each byte under the float16
  exponent byte of 1024 (``0x64``: the byte is then the low 8 of the 10 mantissa bits), a mask
  keeps one nibble (``1024 + n`` and ``1024 + 16 n``) and a ``sub.f16x2`` takes 1024 away: the
  low nibble reads ``n``, the high one ``16 n``.
"""
from __future__ import annotations

import jax
import numpy as np

from kvjax import quant


def _table_words() -> tuple[int, int]:
  """The float16 high bytes of the 8 e2m1 magnitudes, as the two words ``prmt`` indexes
  (byte ``m`` of the pair: magnitude code ``m``)."""
  with jax.ensure_compile_time_eval():   # values now, also when first imported under a trace
    values = np.asarray(quant.e2m1_decode(np.arange(8, dtype=np.uint8)), np.float16)
  bits = values.view(np.uint16).astype(np.uint32)
  assert not (bits & 0xFF).any(), "an e2m1 magnitude's float16 low byte is not zero"
  high = bits >> 8
  words = [int(sum(int(high[4 * w + i]) << (8 * i) for i in range(4))) for w in range(2)]
  return words[0], words[1]


TABLE_LO, TABLE_HI = _table_words()

#: e2m1: ``$2`` (bytes ``b0 b1`` in its low 16 bits; the high 16 bits are ignored) -> ``$0``,
#: the float16x2 of the low nibbles of b0 and b1, and ``$1``, that of their high nibbles
#: (constraints ``=r,=r,r``). ``y = x << 4`` holds the low nibbles where ``x`` holds the high
#: ones; ``0x7070`` keeps the magnitude bits at selector nibbles 1 and 3; the sign ``prmt``
#: puts bytes 0 and 1 (sign bits 7 and 15) under bytes 1 and 3 (bits 15 and 31); ``lop3``
#: 0xF8 is ``a | (b & c)``.
E2M1_PTX = f"""{{
.reg .b32 y, sel_lo, sel_hi, mag_lo, mag_hi, sgn_lo, sgn_hi;
shl.b32 y, $2, 4;
and.b32 sel_lo, y, 0x7070;
and.b32 sel_hi, $2, 0x7070;
prmt.b32 mag_lo, {TABLE_LO:#010x}, {TABLE_HI:#010x}, sel_lo;
prmt.b32 mag_hi, {TABLE_LO:#010x}, {TABLE_HI:#010x}, sel_hi;
prmt.b32 sgn_lo, y, 0, 0x1000;
prmt.b32 sgn_hi, $2, 0, 0x1000;
lop3.b32 $0, mag_lo, sgn_lo, 0x80008000, 0xF8;
lop3.b32 $1, mag_hi, sgn_hi, 0x80008000, 0xF8;
}}"""

#: int4 (unsigned codes): ``$2`` as above -> ``$0``, the float16x2 ``(n_0, n_1)`` of the low
#: nibbles, and ``$1``, ``(16 m_0, 16 m_1)`` of the high ones.
INT4_PTX = """{
.reg .b32 t, lo, hi, bias;
prmt.b32 t, $2, 0x64, 0x4140;
mov.b32 bias, 0x64006400;
and.b32 lo, t, 0xFF0FFF0F;
and.b32 hi, t, 0xFFF0FFF0;
sub.rn.f16x2 $0, lo, bias;
sub.rn.f16x2 $1, hi, bias;
}"""


def to_f16_halves(codes, ptx: str):
  """uint8 ``codes (T, W)`` in the ``WGMMA_UPCAST_2X`` layout (two codes a byte, low nibble
  first) -> ``(low nibbles, high nibbles)`` by ``ptx`` (:data:`E2M1_PTX`, :data:`INT4_PTX`),
  float16 ``(T, W)`` each in the WGMMA layout. The bytes move to the WGMMA layout first (one
  warp shuffle and one byte permute per 4 bytes). Compiled kernels only."""
  import jax.numpy as jnp   # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu   # noqa: PLC0415
  out = plgpu.ShapeDtypeStruct(tuple(codes.shape), jnp.float16, plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_2X,), return_type=(out, out))
  def convert(_, x):
    return _convert_fragments(x, ptx)

  return convert(codes)


def _convert_fragments(x, ptx: str):
  """Mosaic GPU: the conversion on a ``FragmentedArray`` (see :func:`to_f16_halves`)."""
  from jax._src.lib.mlir import ir   # noqa: PLC0415
  from jax._src.lib.mlir.dialects import arith, llvm   # noqa: PLC0415
  import jax.experimental.mosaic.gpu as mgpu   # noqa: PLC0415
  from jax.experimental.mosaic.gpu import utils   # noqa: PLC0415
  x = x.to_layout(mgpu.WGMMA_LAYOUT)            # a register: vector<2xi8>
  i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
  pair = ir.VectorType.get((2,), ir.F16Type.get())
  results = llvm.StructType.get_literal([i32, i32])
  halves = (np.empty_like(x.registers), np.empty_like(x.registers))
  for idx, reg in np.ndenumerate(x.registers):
    word = arith.extui(i32, utils.bitcast(reg, i16))
    both = llvm.inline_asm(results, [word], ptx, "=r,=r,r")
    for k, half in enumerate(halves):
      half[idx] = utils.bitcast(llvm.extractvalue(i32, both, [k]), pair)
  return tuple(mgpu.FragmentedArray(_registers=h, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
               for h in halves)
