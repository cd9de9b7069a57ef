"""float16 dot operands from *pairs* of one-byte codes: a uint16 word holds the codes of two
neighbouring head dims (low byte: the even one), and one conversion yields both.

Why pairs. Triton moves an 8-bit tile into the layout of a tensor-core operand through shared
memory; for the operand whose reduction runs over keys (V in ``p @ V``) the 8-bit element
has no transposing ``ldmatrix``, so every byte is read back alone (``LDS.U8``) and then
assembled into registers (sm_90 machine code: 64 byte loads and ~110 moves per 64 keys, 168
registers a thread for fp8). Read as uint16 words, the same bytes are 16-bit elements: they
travel with ``ldmatrix`` (transposing where needed) like a bfloat16 tile, and the kernel
splits each word into an even-dims and an odd-dims float16 operand in registers. The dots
then run over (even, odd) head-dim halves, as the packed formats' kernels already do
(:attr:`pallas_kernels.triton.formats.TileFormat.split`).

Compiled for CUDA (``ptx``), a register holding two words becomes two float16x2 registers:
a byte permute and one ``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2`` each for fp8 (sm_89 and newer);
for int8 a byte permute under the float16 exponent of 1024 and one subtraction of the bias
pair each (as :func:`kvjax.quant.int8_to_f16`; taking the bias out of whole dot products with
a row-sum correction instead compiled to more machine code, not less). Otherwise
(interpret mode, other targets) the same values come from :mod:`kvjax.quant`'s element
formulas. Every value is exact in float16 either way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import quant

_U16 = jnp.uint16

#: One-byte code types that have a pair conversion, by numpy dtype name.
_FP8_PTX = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
PAIR_CODES = (*_FP8_PTX, "int8")

#: ``prmt`` selectors: fp8 gathers the even bytes of a register's two words into its low half
#: and the odd ones into its high half; int8 puts one parity's bytes under the bias byte 0x64.
_FP8_SPLIT = "0x3120"
_INT8_PICK = {"even": "0x4240", "odd": "0x4341"}


def has_pairs(code_dtype) -> bool:
  """Whether codes of ``code_dtype`` (the codec's ``quant``) have a pair conversion."""
  try:
    return np.dtype(code_dtype).name in PAIR_CODES
  except TypeError:        # "int4", "e2m1": not a numpy dtype
    return False


def min_capability(code_dtype) -> tuple[int, int]:
  """Lowest CUDA compute capability whose PTX has the pair conversion of ``code_dtype``."""
  return (8, 9) if np.dtype(code_dtype).name in _FP8_PTX else (5, 3)


def cuda_capability():
  """(major, minor) compute capability of the first CUDA device, or None without one."""
  try:
    dev = jax.devices("cuda")[0]
  except (RuntimeError, ValueError):     # no CUDA backend in this process
    return None
  cc = getattr(dev, "compute_capability", None)
  return None if cc is None else tuple(int(x) for x in str(cc).split(".")[:2])


def pairs_in_ptx(code_dtype) -> bool:
  """Whether compiled kernels convert ``code_dtype`` pairs with PTX here: a CUDA device of
  at least :func:`min_capability` (ROCm and older GPUs take the element formulas)."""
  cc = cuda_capability()
  return cc is not None and has_pairs(code_dtype) and cc >= min_capability(code_dtype)


def _ptx(code_dtype, half: str) -> str:
  """PTX turning one register of two words into the float16x2 of their ``half`` codes."""
  name = np.dtype(code_dtype).name
  if name in _FP8_PTX:
    part = "pe" if half == "even" else "po"
    return ("{ .reg .b32 t; .reg .b16 pe, po; "
            f"prmt.b32 t, $1, 0, {_FP8_SPLIT}; mov.b32 {{pe, po}}, t; "
            f"cvt.rn.f16x2.{_FP8_PTX[name]}x2 $0, {part}; }}")
  # int8: the bytes x ^ 0x80 under float16 1024's exponent byte hold 1024 + x + 128; minus 1152
  return ("{ .reg .b32 t, u, b; xor.b32 u, $1, 0x80808080; "
          f"prmt.b32 t, u, 0x64646464, {_INT8_PICK[half]}; mov.b32 b, 0x64806480; "
          "sub.rn.f16x2 $0, t, b; }")


def pair_to_f16(words, code_dtype, ptx: bool):
  """uint16 ``words`` (any shape) of two ``code_dtype`` codes -> (even, odd) float16 values.

  ``ptx``: convert with the PTX above (compiled Triton for CUDA at
  :func:`min_capability`); else with :mod:`kvjax.quant`'s formulas (same values).
  """
  name = np.dtype(code_dtype).name
  if ptx:
    from jax.experimental.pallas import triton as pltriton
    out = jax.ShapeDtypeStruct(words.shape, jnp.float16)
    return tuple(
        pltriton.elementwise_inline_asm(_ptx(code_dtype, half), args=[words],
                                        constraints="=r,r", pack=2,
                                        result_shape_dtypes=[out])[0]
        for half in ("even", "odd"))
  lo = (words & _U16(0xFF)).astype(jnp.uint8)
  hi = (words >> _U16(8)).astype(jnp.uint8)
  if name == "int8":
    return tuple(quant.int8_to_f16(quant.from_bits(b, jnp.int8)) for b in (lo, hi))
  return tuple(quant.from_bits(b, code_dtype).astype(jnp.float16) for b in (lo, hi))
