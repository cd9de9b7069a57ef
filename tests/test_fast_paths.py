"""The kernels' fast paths against their plain counterparts and the reference.

- float16 dot operands built from the stored bits (:mod:`kvjax.quant`) are exact for every
  code;
- the decode kernel's variants (float16 operands from bits or by conversion, bfloat16
  operands, row scales as float32 words or as four bytes) all match the reference;
- prefill-heavy batches on quantized caches read a plain copy of their pages
  (:mod:`kvjax.plain_copy`): the rule, the copy's values, and attention through it.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import plain_copy as PC
from kvjax import quant
from kvjax.reference import unified_attention as ref_attention
from kv_testing import poisoned_ragged_batch
from op_suite import triton_interpret

INTERPRET = triton_interpret()   # interpret mode on CPU; compiled on a GPU

ALL_BYTES = jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8)


def _f32(x):
  return np.asarray(x.astype(jnp.float32))


def test_float16_operands_are_exact_for_every_code():
  np.testing.assert_array_equal(_f32(quant.int8_to_f16(ALL_BYTES.view(jnp.int8))),
                                np.arange(256).astype(np.uint8).view(np.int8))
  lo, hi16 = quant.nibbles_to_f16(ALL_BYTES)
  np.testing.assert_array_equal(_f32(lo), np.arange(256) & 15)
  np.testing.assert_array_equal(_f32(hi16), 16 * (np.arange(256) >> 4))
  for got, code in zip(quant.e2m1_pair_to_f16(ALL_BYTES), quant.nibbles(ALL_BYTES)):
    want = np.asarray(quant.e2m1_decode(code))
    np.testing.assert_array_equal(_f32(got), want)
    np.testing.assert_array_equal(np.signbit(_f32(got)), np.signbit(want))    # -0.0 too
  x = jnp.asarray([1e6, -1e6, 3.0, -0.5, np.nan], jnp.bfloat16)
  np.testing.assert_array_equal(_f32(quant.to_f16_saturating(x)),
                                [65504.0, -65504.0, 3.0, -0.5, np.nan])


# -- decode kernel variants -------------------------------------------------------------------
DECODE_VARIANTS = {
    "default": {},
    "convert": dict(fast_decode=False),
    "bf16_operands": dict(compute_dtype="bfloat16", fast_decode=False),
    "byte_scales": dict(scale_words=False),
}


@pytest.mark.parametrize("variant", sorted(DECODE_VARIANTS))
@pytest.mark.parametrize("cache_dtype,layout", [("int8_per_token_head", "NHD"),
                                                ("int4_per_token_head", "HND"),
                                                ("nvfp4", "HND")])
def test_decode_variants_match_the_reference(rng, cache_dtype, layout, variant):
  from pallas_kernels.triton.decode import paged_decode_attention
  from pallas_kernels.triton.decode_config import DecodeConfig
  spec = kvjax.KVCacheSpec(2, 64, 16, cache_dtype, layout)
  ks = 0.5 if spec.codec.has_tensor_scales else None
  q_lens, ctx = (1, 1, 1, 1), (40, 0, 17, 70)
  q, cache, qsl, sl, bt = poisoned_ragged_batch(rng, spec, 8, q_lens, ctx, 0, ks, ks)
  kw = dict(seq_lens=sl, block_table=bt, scale=0.125, k_scale=ks, v_scale=ks)
  cfg = DecodeConfig(**DECODE_VARIANTS[variant])
  out = paged_decode_attention(jnp.full_like(q, jnp.nan).at[:].set(q), cache, spec,
                               interpret=INTERPRET, config=cfg, **kw)
  ref = ref_attention(q, cache, spec, query_start_loc=qsl, **kw)
  err = np.linalg.norm(_f32(out) - _f32(ref)) / np.linalg.norm(_f32(ref))
  assert np.isfinite(_f32(out)).all() and err < 1e-2, err


# -- plain copy --------------------------------------------------------------------------------
def test_the_plain_copy_rule():
  fp8 = kvjax.KVCacheSpec(8, 128, 16, "fp8")
  # 4 x 4096 prefill: one query token per KV token of capacity
  assert PC.worth_a_plain_copy(fp8, jnp.bfloat16, 16384, 4, 256)
  assert PC.worth_a_plain_copy(fp8, jnp.bfloat16, 1024, 1, 256)          # 1/4: the bound
  assert not PC.worth_a_plain_copy(fp8, jnp.bfloat16, 1023, 1, 256)
  assert not PC.worth_a_plain_copy(fp8, jnp.float32, 16384, 4, 256)     # 16-bit q only
  assert not PC.worth_a_plain_copy(kvjax.KVCacheSpec(8, 128, 16), jnp.bfloat16, 16384, 4, 256)
  big = PC.MAX_COPY_BYTES // PC.copy_bytes(fp8, 1, 1, jnp.bfloat16) + 1   # pages past the cap
  assert not PC.worth_a_plain_copy(fp8, jnp.bfloat16, 16 * big, 1, big)


@pytest.mark.parametrize("cache_dtype,layout", [("fp8_per_token_head", "HND"),
                                                ("int4_per_token_head", "NHD")])
def test_the_plain_copy_holds_the_dequantized_pages(rng, cache_dtype, layout):
  spec = kvjax.KVCacheSpec(2, 64, 16, cache_dtype, layout)
  q, cache, qsl, sl, bt = poisoned_ragged_batch(rng, spec, 4)
  bad = bt.at[0, 0].set(10**6)                                  # clamped to B - 1, as kernels do
  pages, plain, table = PC.plain_pages(cache, spec, bad, dtype=jnp.bfloat16)
  assert plain.cache_dtype == "auto" and plain.layout == layout
  assert pages.shape == plain.physical_shape(bt.size) and pages.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(table).ravel(), np.arange(bt.size))
  ids = np.minimum(np.asarray(bad).ravel(), cache.shape[0] - 1)
  k, v = spec.codec.dequantize(cache[ids], spec)
  pk, pv = plain.codec.dequantize(pages, plain)
  np.testing.assert_array_equal(_f32(pk), _f32(k.astype(jnp.bfloat16)))
  np.testing.assert_array_equal(_f32(pv), _f32(v.astype(jnp.bfloat16)))


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("cache_dtype,layout", [("int8_per_token_head", "HND"), ("nvfp4", "HND")])
def test_ragged_attention_with_and_without_the_plain_copy(rng, cache_dtype, layout, plain):
  from pallas_kernels.triton.ragged import ragged_paged_attention
  spec = kvjax.KVCacheSpec(2, 64, 16, cache_dtype, layout)
  ks = 0.5 if spec.codec.has_tensor_scales else None
  q, cache, qsl, sl, bt = poisoned_ragged_batch(rng, spec, 8, k_scale=ks, v_scale=ks)
  kw = dict(query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=0.125, k_scale=ks,
            v_scale=ks)
  out = jax.jit(lambda q, c: ragged_paged_attention(q, c, spec, interpret=INTERPRET,
                                                    plain_copy=plain, **kw))(q, cache)
  ref = ref_attention(q, cache, spec, **kw)
  o, r = _f32(out), _f32(ref)
  assert np.isfinite(o).all()
  np.testing.assert_array_equal(o[int(qsl[-1]):], 0.0)          # padding rows
  err = np.linalg.norm(o - r) / np.linalg.norm(r)
  assert err < (1e-2 if plain else 5e-3), err   # the copy rounds K/V to bf16 once
