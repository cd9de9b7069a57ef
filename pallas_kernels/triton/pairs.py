"""float16 dot operands from uint16 *words* of codes: a word holds the codes of two
neighbouring head dims (one-byte codes, low byte: the even one) or of four (4-bit codes), and
one conversion a part yields them.

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

Codes of half a byte (int4, e2m1; the low nibble holds the even element) are read the same
way: a uint16 word holds the codes of four neighbouring head dims, and the dots run over four
parts (head dims ``4i + j``). Compiled for CUDA, each part of a register of two words is:

- int4: one ``lop3`` (the nibble masked under float16 1024's exponent; the odd nibbles stay 4
  bits up, so their values carry a factor 16 the dots divide out) and one ``sub.f16x2`` of
  1024 (the high byte's nibbles shifted down first), as :func:`kvjax.quant.nibbles_to_f16`
  does per byte;
- e2m1: two shifts, an ``and`` and a ``lop3`` placing the magnitude bits at float16 bits 9-11
  and the sign at bit 15 (``value * 2**-14`` for every code, subnormals included), and one
  ``mul.f16x2`` by 2**14, as :func:`kvjax.quant.e2m1_pair_to_f16` does per byte.

Read as bytes, these tiles too went through shared memory a byte at a time, and each nibble
was converted alone (sm_90 machine code per 64 keys, built offline: nvfp4 1297 -> 883
instructions and 168 -> 128 registers a thread, int4 1060 -> 811 instructions).
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
#: Codes of half a byte, by the codec's name (``Codec.quant``): a uint16 word holds four.
#: The factor each part of :func:`nibble_words_to_f16` carries (int4's odd nibbles stay 4
#: bits up).
NIBBLE_FACTORS = {"int4": (1.0, 16.0, 1.0, 16.0), "e2m1": (1.0, 1.0, 1.0, 1.0)}
NIBBLE_CODES = tuple(NIBBLE_FACTORS)

#: ``prmt`` selectors: fp8 gathers the even bytes of a register's two words into its low half
#: and the odd ones into its high half; int8 puts one parity's bytes under the bias byte 0x64.
_FP8_SPLIT = "0x3120"
_INT8_PICK = {"even": "0x4240", "odd": "0x4341"}


def code_name(code_dtype) -> str:
  """A codec's ``quant`` by name: a numpy dtype's name, or the string itself for the codes
  numpy has no dtype for ("int4", "e2m1"; ``np.dtype("int4")`` would be int32)."""
  if isinstance(code_dtype, str) and code_dtype in ("int4", "e2m1"):
    return code_dtype
  return np.dtype(code_dtype).name


def codes_per_word(code_dtype) -> int:
  """Codes of ``code_dtype`` a uint16 word holds and one conversion splits (2 for one-byte
  codes, 4 for int4 and e2m1), or 0 when it has no word conversion here."""
  name = code_name(code_dtype)
  return 2 if name in PAIR_CODES else 4 if name in NIBBLE_CODES else 0


def has_pairs(code_dtype) -> bool:
  """Whether codes of ``code_dtype`` (the codec's ``quant``) have a word conversion."""
  return codes_per_word(code_dtype) > 0


def min_capability(code_dtype) -> tuple[int, int]:
  """Lowest CUDA compute capability whose PTX has the word conversion of ``code_dtype``."""
  return (8, 9) if code_name(code_dtype) in _FP8_PTX else (5, 3)


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
  """PTX turning one register of two words into the float16x2 of their ``half`` codes (one
  asm a result: JAX's Triton lowering takes inline asm of a single result)."""
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
  if ptx:
    return _run_ptx(words, [_ptx(code_dtype, half) for half in ("even", "odd")])
  if np.dtype(code_dtype).name == "int8":
    return tuple(quant.int8_to_f16(quant.from_bits(b, jnp.int8)) for b in _bytes(words))
  return tuple(quant.from_bits(b, code_dtype).astype(jnp.float16) for b in _bytes(words))


def _run_ptx(words, snippets):
  """float16 tiles, one a PTX snippet run over uint16 ``words`` two at a time (a 32-bit
  register in, a float16x2 register out; one inline asm a result)."""
  from jax.experimental.pallas import triton as pltriton
  out = jax.ShapeDtypeStruct(words.shape, jnp.float16)
  return tuple(pltriton.elementwise_inline_asm(ptx, args=[words], constraints="=r,r", pack=2,
                                               result_shape_dtypes=[out])[0]
               for ptx in snippets)


def _bytes(words):
  """uint16 words -> (low bytes, high bytes) as uint8."""
  return (words & _U16(0xFF)).astype(jnp.uint8), (words >> _U16(8)).astype(jnp.uint8)


#: ``lop3`` truth table of ``(a & b) | c``.
_AND_OR = "0xEA"


def _shift(dst: str, bits: int) -> str:
  """PTX moving ``$1`` left by ``bits`` (right when negative) into ``dst``."""
  if bits == 0:
    return f"mov.b32 {dst}, $1; "
  return (f"shl.b32 {dst}, $1, {bits}; " if bits > 0 else f"shr.b32 {dst}, $1, {-bits}; ")


def _nibble_ptx(code: str, part: int) -> str:
  """PTX turning one register of two words into the float16x2 of their nibbles ``part``
  (0-3, from the low bits up), times ``NIBBLE_FACTORS[code][part]``."""
  o = 4 * part
  if code == "int4":
    mask = "0x00F000F0" if part % 2 else "0x000F000F"
    return ("{ .reg .b32 t, b; " + _shift("t", -8 if part >= 2 else 0) +
            f"lop3.b32 t, t, {mask}, 0x64006400, {_AND_OR}; mov.b32 b, 0x64006400; "
            "sub.rn.f16x2 $0, t, b; }")
  # e2m1: magnitude bits o..o+2 -> 9..11, sign bit o+3 -> 15; then times 2**14 (0x7400)
  return ("{ .reg .b32 t, u, c; " + _shift("t", 9 - o) + _shift("u", 12 - o) +
          "and.b32 u, u, 0x80008000; "
          f"lop3.b32 t, t, 0x0E000E00, u, {_AND_OR}; mov.b32 c, 0x74007400; "
          "mul.rn.f16x2 $0, t, c; }")


def nibble_words_to_f16(words, code: str, ptx: bool):
  """uint16 ``words`` (any shape) of four ``code`` codes ("int4", "e2m1"; low nibble first)
  -> four float16 tiles, part ``j`` the values of head dims ``4i + j`` times
  ``NIBBLE_FACTORS[code][j]``; exact.

  ``ptx``: convert with the PTX above (compiled Triton for CUDA); else with
  :func:`kvjax.quant.nibbles_to_f16` / :func:`kvjax.quant.e2m1_pair_to_f16` on each byte.
  """
  if ptx:
    return _run_ptx(words, [_nibble_ptx(code, j) for j in range(4)])
  per_byte = quant.nibbles_to_f16 if code == "int4" else quant.e2m1_pair_to_f16
  lo, hi = _bytes(words)
  return (*per_byte(lo), *per_byte(hi))
