"""Words of codes as float16 (pallas_kernels.triton.pairs), outside any kernel: every uint16
word against numpy's own decoding of its two bytes or four nibbles, and the PTX snippets the
compiled kernels use (the Triton kernels' and pallas_kernels.mosaic_gpu.nibbles'), run by a
small interpreter of their instructions, against the same."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.triton import pairs

WORDS = np.arange(1 << 16, dtype=np.uint16)


@pytest.mark.parametrize("code", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8])
def test_every_word_splits_into_its_even_and_odd_values(code):
  even, odd = pairs.pair_to_f16(jnp.asarray(WORDS), code, ptx=False)
  assert even.dtype == odd.dtype == jnp.float16
  low = (WORDS & 0xFF).astype(np.uint8).view(np.dtype(code))
  high = (WORDS >> 8).astype(np.uint8).view(np.dtype(code))
  for got, want in ((even, low), (odd, high)):
    want = want.astype(np.float32)
    got = np.asarray(got, np.float32)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{np.count_nonzero(~same)} of 65536 words differ"


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


@pytest.mark.parametrize("code", ["int4", "e2m1"])
def test_every_word_splits_into_its_four_nibbles(code):
  parts = pairs.nibble_words_to_f16(jnp.asarray(WORDS), code, ptx=False)
  for j, (got, f) in enumerate(zip(parts, pairs.NIBBLE_FACTORS[code])):
    assert got.dtype == jnp.float16
    nib = (WORDS >> (4 * j)) & 0xF
    want = (nib.astype(np.float32) if code == "int4" else E2M1[nib]) * f
    got = np.asarray(got, np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_which_codes_have_pairs_and_where_ptx_runs(monkeypatch):
  assert pairs.has_pairs(jnp.float8_e4m3fn) and pairs.has_pairs(jnp.int8)
  assert pairs.codes_per_word("int4") == pairs.codes_per_word("e2m1") == 4
  assert pairs.codes_per_word(jnp.int8) == 2
  assert not pairs.has_pairs(jnp.bfloat16)
  monkeypatch.setattr(pairs, "cuda_capability", lambda: (8, 0))      # A100: no fp8 cvt
  assert not pairs.pairs_in_ptx(jnp.float8_e4m3fn) and pairs.pairs_in_ptx(jnp.int8)
  monkeypatch.setattr(pairs, "cuda_capability", lambda: (9, 0))
  assert pairs.pairs_in_ptx(jnp.float8_e5m2)
  monkeypatch.setattr(pairs, "cuda_capability", lambda: None)        # CPU, ROCm
  assert not pairs.pairs_in_ptx(jnp.int8)


# -- the PTX itself, run by a small interpreter of the instructions it uses -------------------
def _f16x2(op, a, b):
  """Lane-wise float16 ``op`` of two uint32 arrays holding float16x2 (round to nearest)."""
  a, b = (np.ascontiguousarray(v, "<u4") for v in np.broadcast_arrays(a, b))
  x, y = (v.view("<f2").astype(np.float32) for v in (a, b))
  return op(x, y).astype(np.float16).view("<u4")


def _prmt(a, b, sel):
  """PTX prmt.b32 (default mode): byte i of the result is byte ``sel``'s nibble i (its low 3
  bits) of {b:a}, or that byte's sign bit repeated where the nibble's bit 3 is set."""
  a, b, sel = (np.asarray(v, np.uint32) for v in np.broadcast_arrays(a, b, sel))
  src = np.stack([(a >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)] +
                 [(b >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)])
  out = np.zeros(a.shape, np.uint32)
  for i in range(4):
    nib = (sel >> np.uint32(4 * i)) & np.uint32(0xF)
    byte = np.take_along_axis(src, (nib & 7)[None].astype(np.intp), 0)[0]
    byte = np.where(nib & 8, np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0)), byte)
    out |= byte.astype(np.uint32) << np.uint32(8 * i)
  return out


def _lop3(a, b, c, table):
  """PTX lop3.b32: each result bit is bit ``4 a + 2 b + c`` of ``table``."""
  out = np.zeros(np.broadcast(a, b, c).shape, np.uint32)
  for k in range(8):
    if table >> k & 1:
      out |= ((a if k & 4 else ~a) & (b if k & 2 else ~b) & (c if k & 1 else ~c))
  return out


def _run(ptx, reg, outputs=("$0",), input_name="$1"):
  """Run one asm snippet on uint32 ``reg`` (``input_name``) -> the ``outputs`` registers
  (int and f16x2 ops only; one output: that array)."""
  env = {input_name: reg.astype(np.uint32)}
  val = lambda t: env[t] if t in env else np.uint32(int(t, 0))
  for stmt in filter(None, (x.strip(" {}\n") for x in ptx.split(";"))):
    op, _, args = stmt.partition(" ")
    if op == ".reg":
      continue
    d, *src = [t.strip() for t in args.split(",")]
    a = [val(t) for t in src]
    env[d] = {"mov.b32": lambda: a[0] + np.uint32(0), "shl.b32": lambda: a[0] << a[1],
              "shr.b32": lambda: a[0] >> a[1], "and.b32": lambda: a[0] & a[1],
              "xor.b32": lambda: a[0] ^ a[1],
              "lop3.b32": lambda: _lop3(a[0], a[1], a[2], int(src[3], 0)),
              "prmt.b32": lambda: _prmt(a[0], a[1], a[2]),
              "sub.rn.f16x2": lambda: _f16x2(np.subtract, a[0], a[1]),
              "mul.rn.f16x2": lambda: _f16x2(np.multiply, a[0], a[1])}[op]()
  got = tuple(env[o].astype(np.uint32) for o in outputs)
  return got[0] if len(got) == 1 else got


@pytest.mark.parametrize("code", ["int4", "e2m1", "int8"])
def test_ptx_splits_both_words_of_a_register(code):
  """Every word in the low and in the high half of a register (the other half random): the
  PTX's float16x2 lanes equal the element formulas of each word."""
  other = np.random.default_rng(0).integers(0, 1 << 16, WORDS.size, dtype=np.uint32)
  if code == "int8":
    snippets, want = [pairs._ptx(jnp.int8, h) for h in ("even", "odd")], pairs.pair_to_f16(
        jnp.asarray(WORDS), jnp.int8, ptx=False)
  else:
    snippets = [pairs._nibble_ptx(code, j) for j in range(4)]
    want = pairs.nibble_words_to_f16(jnp.asarray(WORDS), code, ptx=False)
  for shift in (0, 16):
    reg = (WORDS.astype(np.uint32) << shift) | (other << (16 - shift))
    for ptx, w in zip(snippets, want):
      lane = (_run(ptx, reg) >> shift) & 0xFFFF
      np.testing.assert_array_equal(lane.astype(np.uint16),
                                    np.asarray(w, np.float16).view(np.uint16))


@pytest.mark.parametrize("code", ["e2m1", "int4"])
def test_mosaic_gpu_nibble_ptx_decodes_every_byte_pair(code):
  """The Mosaic GPU kernels' nibble conversions (pallas_kernels.mosaic_gpu.nibbles): every two
  bytes (the register's high half random) -> the float16x2 of their low nibbles and of their
  high nibbles, bit for bit (signs of zero included); int4's high nibbles read 16 n."""
  from pallas_kernels.mosaic_gpu import nibbles
  ptx, table, high_factor = {"e2m1": (nibbles.E2M1_PTX, E2M1, 1),
                             "int4": (nibbles.INT4_PTX, np.arange(16, dtype=np.float32), 16)}[code]
  high = np.random.default_rng(1).integers(0, 1 << 16, WORDS.size, dtype=np.uint32)
  reg = WORDS.astype(np.uint32) | (high << np.uint32(16))
  lo, hi = _run(ptx, reg, outputs=("$0", "$1"), input_name="$2")
  for got, shift, factor in ((lo, 0, 1), (hi, 4, high_factor)):
    want = np.stack([table[(WORDS >> (8 * b + shift)) & 0xF] for b in range(2)], -1) * factor
    got = got.view("<f2").reshape(-1, 2).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
