"""int4 per token-head is vLLM 0.28's int4 (docs/layout.md §5): rotated rows, vLLM's quantizer.

(a) A numpy model of vLLM's int4 write, written from its documented arithmetic, against the
    bytes kvjax stores (reference eager and jitted, the Triton kernel in interpret mode).
(b) Attention on an int4 cache against float64 attention over the original K/V, with a bound
    that a cache read without its rotation misses by far.
(c) ``read_kv`` returns the original K/V (un-rotated), within the int4 bound.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import rotation
from attention_cases import numpy_attention

F32, U32 = np.float32, np.uint32


# -- (a) vLLM's int4 write, in numpy ------------------------------------------------------------
def _walsh_hadamard(x):
  """Unnormalized Walsh-Hadamard transform of the last axis in float32, butterfly order:
  stage h = 1, 2, 4, ... maps each pair (i, i + h) of a block of 2h to (a + b, a - b)."""
  x = np.array(x, F32)
  d = x.shape[-1]
  h = 1
  while h < d:
    for start in range(0, d, 2 * h):
      a = x[..., start:start + h].copy()
      b = x[..., start + h:start + 2 * h].copy()
      x[..., start:start + h] = a + b
      x[..., start + h:start + 2 * h] = a - b
    h *= 2
  return x


def _round_half_away(v):
  """vLLM's rounding: add +-0.5 in float32 (by the sign), then truncate (a float -> int
  conversion)."""
  v = np.asarray(v, F32)
  return np.where(v >= 0, np.trunc(v + F32(0.5)), np.trunc(v - F32(0.5))).astype(F32)


def vllm_int4_rows(x, model_dtype):
  """vLLM's int4 write of rows ``x [..., D]`` (model dtype) -> (packed uint8 ``[..., D/2]``,
  stored-scale bits uint32 ``[...]``).

  1. rotate: ``H(x * signs)`` in float32, rounded to the model dtype;
  2. ``scale = max((max - min) / 15, 1e-6)``, the division by the literal 15 being a product
     with float32(1/15) (Triton's ``div.full.f32``, as measured for fp8's 448);
  3. ``r = 1 / scale``; ``zp = clamp(round(-min * r), 0, 15)``;
     ``q = clamp(round(x * r + zp), 0, 15)`` with ``x * r + zp`` one fused multiply-add;
  4. two codes a byte, the even element in the low nibble; stored scale =
     ``(bits(scale) & ~0xF) | zp``.
  """
  d = x.shape[-1]
  y = _walsh_hadamard(np.asarray(x, F32) * rotation.rht_signs(d))
  y = y.astype(model_dtype).astype(F32)
  lo, hi = y.min(-1), y.max(-1)
  scale = np.maximum((hi - lo) * (F32(1) / F32(15)), F32(1e-6)).astype(F32)
  r = (F32(1) / scale).astype(F32)
  zp = np.clip(_round_half_away(-lo * r), 0, 15)
  fma = (y.astype(np.float64) * r[..., None] + zp[..., None]).astype(F32)   # one rounding
  q = np.clip(_round_half_away(fma), 0, 15).astype(np.uint8)
  packed = q[..., 0::2] | (q[..., 1::2] << 4)
  bits = (scale.view(U32) & U32(0xFFFFFFF0)) | zp.astype(U32)
  return packed, bits


def _integer_rotated_rows(rng, num, d):
  """float32 rows whose rotation is exactly a row of small integers (``x = signs * H(y) / D``):
  rotated values on code boundaries, symmetric rows (zero point 7.5 before rounding), rows
  of one value."""
  y = rng.integers(-15, 16, (num, d)).astype(F32)
  y[0, :2] = [-15, 15]                            # symmetric extremes
  y[1] = 3.0                                      # a constant row: scale 1e-6
  y[2, :] = np.where(np.arange(d) % 2, 7.0, -8.0)
  return (_walsh_hadamard(y) * F32(1.0 / d) * rotation.rht_signs(d)).astype(F32)


def _stored_rows(cache, spec, slots):
  """(K data, K scale bits, V data, V scale bits) of the given slots."""
  n = spec.block_size
  pages = jnp.asarray(cache)
  k, v = kvjax.kv_views(pages, spec)
  ks, vs = kvjax.kv_scale_views(pages, spec)
  blk, off = np.asarray(slots) // n, np.asarray(slots) % n
  pick = lambda a: np.asarray(a)[blk, off]
  return pick(k), pick(ks).view(U32), pick(v), pick(vs).view(U32)


WRITE_CASES = [("NHD", 64, jnp.bfloat16, "random"), ("HND", 128, jnp.float16, "random"),
               ("NHD", 32, jnp.float32, "integer"), ("HND", 16, jnp.bfloat16, "random"),
               pytest.param("HND", 256, jnp.float32, "random", marks=pytest.mark.slow)]


@pytest.mark.parametrize("layout,d,dtype,rows", WRITE_CASES)
def test_stored_bytes_equal_vllms_int4_write(rng, layout, d, dtype, rows):
  # On the CPU: XLA's GPU compile of the reference rounds differently in the last bit (the
  # bytes on the GPU are measured against vLLM's own writer by check_vllm_interop.py).
  with jax.default_device(jax.devices("cpu")[0]):
    _check_stored_bytes(rng, layout, d, dtype, rows)


def _check_stored_bytes(rng, layout, d, dtype, rows):
  spec = kvjax.KVCacheSpec(2, d, 16, "int4_per_token_head", layout, dtype)
  t = 24
  if rows == "integer":
    kv = _integer_rotated_rows(rng, 2 * t * 2, d).reshape(2, t, 2, d)
  else:
    kv = (rng.standard_normal((2, t, 2, d)) * np.exp(rng.uniform(-2, 2, (2, t, 2, 1))))
    kv[:, 0, 0, 3] = 40.0                          # an outlier the rotation spreads out
  key, value = (jnp.asarray(x.astype(F32)).astype(dtype) for x in kv)
  slots = jnp.asarray(rng.choice(4 * 16, t, replace=False).astype(np.int32))
  want = []
  for x in (key, value):
    want += list(vllm_int4_rows(np.asarray(x)[:t], dtype))
  write = functools.partial(kvjax.write_kv, spec=spec)
  writers = {"reference eager": lambda c: write(c, key, value, slots, impl="reference"),
             "reference jit": lambda c: jax.jit(lambda c, k, v, s: write(
                 c, k, v, s, impl="reference"))(c, key, value, slots),
             "triton interpret": lambda c: write(c, key, value, slots, impl="pallas",
                                                 interpret=True)}
  for name, run in writers.items():
    got = _stored_rows(run(spec.allocate(4)), spec, slots)
    for part, g, w in zip(("K data", "K scale", "V data", "V scale"), got, want):
      np.testing.assert_array_equal(g, w, err_msg=f"{name}: {part}")


def test_round_half_away_is_vllms_add_half_and_truncate():
  v = np.concatenate([np.arange(-20, 20) + 0.5, [0.49999997, -0.49999997, 2.5, -2.5, 0.0]])
  v = v.astype(F32)
  np.testing.assert_array_equal(np.asarray(kvjax.quant.round_half_away_from_zero(jnp.asarray(v))),
                                _round_half_away(v))


# -- (b) attention, (c) reads ---------------------------------------------------------------------
def _batch(rng, spec, q_lens, prefix, hq):
  """A ragged batch over shuffled pages: (q, cache, meta, per-sequence float64 K and V)."""
  n = spec.block_size
  seq_lens = np.asarray(q_lens) + np.asarray(prefix)
  nb = [-(-int(s) // n) for s in seq_lens]
  perm = rng.permutation(sum(nb) + 2)
  table = np.zeros((len(q_lens), max(nb)), np.int32)
  cursor = 0
  for i, b in enumerate(nb):
    table[i, :b] = perm[cursor:cursor + b]
    cursor += b
  slots = np.concatenate([table[i, np.arange(s) // n] * n + np.arange(s) % n
                          for i, s in enumerate(seq_lens)]).astype(np.int32)
  kv = rng.standard_normal((2, len(slots), spec.num_kv_heads, spec.head_size))
  kv *= np.exp(rng.uniform(-1, 1, (2, len(slots), spec.num_kv_heads, 1)))
  kv[:, :, :, 5] *= 8.0                            # an outlier channel, as LLM keys have
  key, value = (jnp.asarray(x.astype(F32)).astype(spec.dtype) for x in kv)
  cache = kvjax.write_kv(spec.allocate(len(perm)), key, value, jnp.asarray(slots), spec)
  starts = np.concatenate([[0], np.cumsum(seq_lens)])
  per_seq = lambda x: [np.asarray(x[starts[i]:starts[i + 1]], np.float64)
                       for i in range(len(q_lens))]
  q = jnp.asarray(rng.standard_normal((int(np.sum(q_lens)), hq, spec.head_size)), spec.dtype)
  meta = dict(query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
              seq_lens=jnp.asarray(seq_lens, jnp.int32), block_table=jnp.asarray(table))
  return q, cache, meta, per_seq(key), per_seq(value), jnp.asarray(slots)


def _rel(out, want):
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  return float(np.linalg.norm(out - want) / np.linalg.norm(want))


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_attention_reads_the_original_kv(rng, impl):
  """Relative error against float64 attention over the original K/V stays at int4's noise
  (0.11-0.15 over seeds); reading the same cache without the rotation (the stored frame, as a
  non-rotating reader would) is off by more than 10."""
  spec = kvjax.KVCacheSpec(2, 64, 16, "int4_per_token_head", "NHD", jnp.bfloat16)
  q, cache, meta, ks, vs, _ = _batch(rng, spec, (9, 1, 1), (20, 33, 0), hq=8)
  scale = 64 ** -0.5
  want = numpy_attention(q, meta, ks, vs, scale=scale)
  interpret = None if impl == "reference" else True
  attend = jax.jit(functools.partial(kvjax.unified_attention, impl=impl, interpret=interpret))
  out = attend(q, cache, spec, scale=jnp.float32(scale), **meta)    # traced scale, spec an arg
  assert out.dtype == q.dtype
  err = _rel(out, want)
  assert err < 0.25, err
  unrotated = kvjax.reference.unified_attention(q, cache, spec, scale=scale, **meta)
  assert _rel(unrotated, want) > 1.0, "the bound must tell a read without rotation apart"


def test_read_kv_returns_the_original_kv(rng):
  """Per element, |read - x| <= half an int4 step of the rotated row plus the model-dtype
  rounding of the rotated values (the inverse rotation averages errors, never grows them);
  the stored (rotated) values are nowhere near x."""
  spec = kvjax.KVCacheSpec(2, 128, 16, "int4_per_token_head", "HND", jnp.bfloat16)
  _, cache, _, ks, vs, slots = _batch(rng, spec, (40,), (0,), hq=2)
  s, n = np.asarray(slots), spec.block_size
  stored = kvjax.views.dequantize_stored(cache, spec)
  for x, back, rotated in zip((ks[0], vs[0]), kvjax.read_kv(cache, spec, slots), stored):
    y = np.asarray(rotation.rht(x.astype(F32)), np.float64)       # the rotated rows
    step = (y.max(-1) - y.min(-1))[..., None] / 15
    bound = step * 0.5 * (1 + 1e-5) + np.abs(y).max(-1, keepdims=True) * 2.0 ** -8
    err = np.abs(np.asarray(back, np.float64) - x)
    assert np.all(err <= bound), float((err / bound).max())
    assert np.sqrt(np.mean(err ** 2)) < 0.1 * step.mean()
    assert np.abs(np.asarray(rotated)[s // n, s % n] - x).max() > 10 * bound.max()
