"""Mosaic TPU kernels (pallas_kernels.mosaic_tpu) vs kvjax.reference, in TPU interpret mode.

On CPU the kernels run with ``interpret=True`` (TPU interpret mode: DMAs, semaphores, VMEM
and SMEM simulated), and ``jax.export`` with ``platforms=["tpu"]`` runs their Pallas-to-Mosaic
lowering (the compile after that needs a TPU). On a TPU (``JAX_PLATFORMS=tpu``) the same cases
run compiled.

Writes: bit-identical bytes to the jitted reference on poisoned caches, padding (-1) and
out-of-range slots mixed in, every byte not named by a slot unchanged. Attention: ragged
batches of pure prefills, chunked prefills on a cached prefix, decodes, an empty sequence and
padding tokens, over shuffled pages; pages no block table names are 0xFF bytes (NaN in every
float format and as per-token-head scales) and slots past a sequence's end hold huge values.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

from kvjax import KVCacheSpec, MLACacheSpec, registry
from kvjax.reference import cache_update as ref_cache
from kvjax.reference import unified_attention as ref_attention
from kv_testing import as_bytes, poisoned_cache, poisoned_ragged_batch, random_kv
import pallas_kernels.mosaic_tpu as mt

NUM_BLOCKS = 4
#: Interpret on CPU; compile on a TPU.
INTERPRET = jax.default_backend() != "tpu"
_ref_write = jax.jit(ref_cache.write_kv, static_argnums=4)


def _scales(rng, spec, per_head):
  """Global (k_scale, v_scale): fp8 per tensor [H] or scalar float32, nvfp4 scalar; None for
  other formats."""
  if spec.format.kind == "nvfp4":
    return tuple(jnp.asarray(rng.uniform(0.05, 0.5), jnp.float32) for _ in range(2))
  if spec.format.kind != "fp8_per_tensor":
    return None, None
  shape = (spec.num_kv_heads,) if per_head else ()
  return tuple(jnp.asarray(rng.uniform(0.05, 0.5, shape), jnp.float32) for _ in range(2))


# -- writes ----------------------------------------------------------------------------------
WRITE_CASES = [
    # cache_dtype, layout, H, D, model dtype, per-head fp8 scales
    ("auto", "NHD", 2, 128, jnp.bfloat16, False),
    ("auto", "HND", 1, 64, jnp.float16, False),
    ("float16", "NHD", 2, 64, jnp.bfloat16, False),
    ("fp8", "HND", 2, 128, jnp.bfloat16, True),
    ("fp8_e5m2", "NHD", 2, 64, jnp.float32, False),
    ("int8_per_token_head", "NHD", 2, 128, jnp.bfloat16, False),
    ("int8_per_token_head", "HND", 2, 64, jnp.float32, False),
    ("fp8_per_token_head", "HND", 2, 128, jnp.float16, False),
    ("int4_per_token_head", "NHD", 2, 128, jnp.bfloat16, False),
    ("int4_per_token_head", "HND", 2, 64, jnp.float32, False),
]


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-H{c[2]}-D{c[3]}")
def test_write_bytes_equal_reference_and_nothing_else_touched(rng, case):
  cd, layout, h, d, dtype, per_head = case
  spec = KVCacheSpec(h, d, 16, cd, layout, dtype)
  num_slots = NUM_BLOCKS * spec.block_size
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  before = as_bytes(cache).copy()
  t = int(rng.integers(9, 20))                       # not a multiple of the 8-token step
  valid = rng.choice(num_slots, t - 4, replace=False)
  slots = rng.permutation(np.concatenate([valid, [-1, -7, num_slots, num_slots + 33]]))
  slots = jnp.asarray(slots.astype(np.int32))
  key, value = random_kv(rng, spec, t + 2)           # 2 tokens past len(slots): ignored
  ks, vs = _scales(rng, spec, per_head)

  write = jax.jit(functools.partial(mt.write_kv, spec=spec, interpret=INTERPRET),
                  donate_argnums=0)
  out = write(cache, key, value, slots, k_scale=ks, v_scale=vs)
  assert cache.is_deleted(), "the donated cache must be aliased to the output"
  want = as_bytes(_ref_write(jnp.asarray(before.view(spec.storage_dtype).reshape(out.shape)),
                             key, value, slots, spec, ks, vs))
  got = as_bytes(out)
  np.testing.assert_array_equal(got, want)

  written = np.zeros(out.shape[:3], bool)            # (block, token, head) rows named by a slot
  blocks, offs = valid // spec.block_size, valid % spec.block_size
  if layout == "NHD":
    written[blocks, offs, :] = True
  else:
    written[blocks, :, offs] = True
  row_bytes = got.reshape(written.shape + (-1,))
  old_bytes = before.reshape(written.shape + (-1,))
  np.testing.assert_array_equal(row_bytes[~written], old_bytes[~written])
  assert (row_bytes[written] != old_bytes[written]).any(axis=-1).all(), "a named row kept its bytes"


def test_write_of_only_skipped_slots_changes_nothing(rng):
  spec = KVCacheSpec(2, 64, 16, "int8_per_token_head", "HND")
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  key, value = random_kv(rng, spec, 3)
  slots = jnp.asarray([-1, NUM_BLOCKS * 16, -5], jnp.int32)
  out = mt.write_kv(cache, key, value, slots, spec, interpret=INTERPRET)
  np.testing.assert_array_equal(as_bytes(out), as_bytes(cache))


# -- attention -------------------------------------------------------------------------------
def _close(o, r, dtype):
  """The tolerance of tests/test_ragged_attention.py (outputs are O(1): unit-normal q, k, v)."""
  tol = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 4e-3}.get(np.dtype(dtype), 2e-2)
  np.testing.assert_allclose(o, r, atol=tol, rtol=tol)


def _run_both(rng, spec, group, *, k_scale=None, v_scale=None, batch=None, interpret=INTERPRET,
              **kw):
  hq = spec.num_kv_heads * group
  q, cache, qsl, sl, bt = batch or poisoned_ragged_batch(rng, spec, hq, k_scale=k_scale,
                                                    v_scale=v_scale)
  args = dict(scale=spec.head_size ** -0.5, k_scale=k_scale, v_scale=v_scale, **kw)
  max_query_len = args.pop("max_query_len", None)

  @jax.jit
  def ours(q, cache, qsl, sl, bt):      # metadata traced
    return mt.ragged_paged_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                     block_table=bt, max_query_len=max_query_len,
                                     interpret=interpret, **args)

  out = ours(q, cache, qsl, sl, bt)
  assert out.shape == q.shape and out.dtype == q.dtype
  o = np.asarray(out, np.float32)
  ref = jax.jit(functools.partial(ref_attention, spec=spec, **args))
  r = np.asarray(ref(q, cache, query_start_loc=qsl, seq_lens=sl, block_table=bt), np.float32)
  assert np.all(o[int(qsl[-1]):] == 0), "padding tokens must output exactly 0"
  assert np.isfinite(r).all() and np.abs(r).max() > 0.1
  return o, r


ATTENTION_CASES = [
    # layout, cache_dtype, model dtype, G, D, (k_scale, v_scale) kind, extra kwargs
    # (the op suite, tests/test_op_attention.py, runs Mosaic TPU on its cases too: plain NHD
    # G4 D64 and int8 per token head there, so here in the slow tier only)
    pytest.param("NHD", "auto", jnp.bfloat16, 4, 64, None, {}, marks=pytest.mark.slow),
    ("HND", "auto", jnp.bfloat16, 1, 128, None, dict(sliding_window=9, soft_cap=4.0,
                                                     sinks=True)),
    ("NHD", "float32", jnp.float32, 2, 64, None, dict(causal=False, sliding_window=30,
                                                      max_query_len=20)),
    ("HND", "fp8", jnp.bfloat16, 4, 128, "per_head", dict(sinks=True)),
    pytest.param("NHD", "fp8_e5m2", jnp.bfloat16, 1, 64, "scalar", dict(sliding_window=12),
                 marks=pytest.mark.slow),
    pytest.param("NHD", "int8_per_token_head", jnp.bfloat16, 2, 128, None, dict(soft_cap=5.0),
                 marks=pytest.mark.slow),
    ("HND", "fp8_per_token_head", jnp.float16, 2, 64, None, dict(max_query_len=32)),
    ("NHD", "int4_per_token_head", jnp.bfloat16, 4, 128, None, dict(sinks=True, soft_cap=5.0)),
    pytest.param("HND", "int4_per_token_head", jnp.float32, 1, 64, None,
                 dict(sliding_window=20, max_query_len=32), marks=pytest.mark.slow),
    ("HND", "nvfp4", jnp.bfloat16, 2, 64, "nvfp4", dict(sinks=True)),   # through a plain copy
]


@pytest.mark.parametrize("layout,cache_dtype,dtype,group,head_size,scales,kw", ATTENTION_CASES)
def test_attention_matches_reference(rng, layout, cache_dtype, dtype, group, head_size, scales,
                                     kw):
  spec = KVCacheSpec(2, head_size, 16, cache_dtype, layout, dtype)
  ks, vs = _scales(rng, spec, scales == "per_head")
  kw = dict(kw)
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.asarray(rng.standard_normal(2 * group) * 2, jnp.float32)
  o, r = _run_both(rng, spec, group, k_scale=ks, v_scale=vs, **kw)
  _close(o, r, dtype)


@pytest.mark.parametrize("layout,cache_dtype,group", [
    ("HND", "fp8", 4), pytest.param("NHD", "auto", 1, marks=pytest.mark.slow)])
def test_decode_batch_matches_reference(rng, layout, cache_dtype, group):
  """One query token per sequence (max_query_len=1, T == S): one-token tiles."""
  spec = KVCacheSpec(2, 128, 16, cache_dtype, layout, jnp.bfloat16)
  ks, vs = _scales(rng, spec, per_head=False)
  ctx = (0, 35, 16, 70, 3)
  batch = poisoned_ragged_batch(rng, spec, 2 * group, q_lens=(1,) * len(ctx), ctx_lens=ctx, pad=0,
                          k_scale=ks, v_scale=vs)
  o, r = _run_both(rng, spec, group, k_scale=ks, v_scale=vs, batch=batch, max_query_len=1,
                   sliding_window=40)
  _close(o, r, jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_no_dma_races(rng, layout):
  """TPU interpret mode's race detector sees no unsynchronized DMA / VMEM access."""
  if not INTERPRET:
    pytest.skip("the race detector is part of TPU interpret mode")
  ipc = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
  if not hasattr(ipc, "races"):
    pytest.skip("this jax keeps the race detector's state elsewhere")
  params = pltpu.InterpretParams(detect_races=True)
  spec = KVCacheSpec(2, 64, 16, "int8_per_token_head", layout, jnp.bfloat16)
  o, r = _run_both(rng, spec, 2, interpret=params, max_query_len=32, sliding_window=20)
  _close(o, r, jnp.bfloat16)
  assert ipc.races is not None and not ipc.races.races_found
  cache = poisoned_cache(rng, spec, NUM_BLOCKS)
  key, value = random_kv(rng, spec, 11)
  slots = jnp.asarray(rng.choice(NUM_BLOCKS * 16, 11, replace=False).astype(np.int32))
  mt.write_kv(cache, key, value, slots, spec, interpret=params).block_until_ready()
  assert not ipc.races.races_found


# -- support lists, lowering -----------------------------------------------------------------
def test_supported_formats_and_reasons():
  assert set(mt.SUPPORTED_CACHE_DTYPES) == {
      "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2",
      "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"}
  for cd in mt.SUPPORTED_CACHE_DTYPES:
    spec = KVCacheSpec(2, 64, 16, cd, "HND")
    assert mt.supports_write(spec) is None
    assert mt.supports_attention(spec, jnp.bfloat16) is None
  spec = KVCacheSpec(2, 64, 16, "nvfp4", "HND")     # attention through a plain copy only
  why = "cache_dtype='nvfp4' has no Mosaic TPU adapter"
  assert mt.supports_write(spec).startswith(why)
  assert mt.supports_attention(spec, jnp.bfloat16) is None
  with pytest.raises(ValueError, match=why):
    mt.write_kv(spec.allocate(2), jnp.zeros((1, 2, 64), jnp.bfloat16),
                jnp.zeros((1, 2, 64), jnp.bfloat16), jnp.zeros((1,), jnp.int32), spec)
  spec = KVCacheSpec(2, 64, 16)
  assert "q dtype int8" in mt.supports_attention(spec, jnp.int8)
  call = lambda seqs, blocks: registry.AttentionCall(num_tokens=seqs, num_q_heads=8,
                                                    num_seqs=seqs, max_blocks=blocks,
                                                    max_query_len=1)
  nvfp4 = KVCacheSpec(8, 128, 16, "nvfp4", "HND")
  assert mt.prefer_attention(nvfp4, jnp.bfloat16, call(8, 64)) is None
  assert "plain copy" in mt.prefer_attention(nvfp4, jnp.bfloat16, call(256, 4096))
  assert mt.prefer_attention(spec, jnp.bfloat16, call(256, 4096)) is None   # read in place
  assert "MLACacheSpec" in mt.supports_write(MLACacheSpec())


def _export_tpu(f, *args):
  return export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()


LOWERING_CASES = [("auto", "NHD", 128), ("int8_per_token_head", "HND", 128),
                  ("int4_per_token_head", "NHD", 128), ("nvfp4", "HND", 128)] + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in [("bfloat16", "HND", 128), ("fp8", "HND", 128), ("fp8_e5m2", "NHD", 64),
                 ("fp8_per_token_head", "NHD", 128), ("float32", "HND", 64),
                 ("int8_per_token_head", "NHD", 64), ("int4_per_token_head", "HND", 64)]]


@pytest.mark.parametrize("cache_dtype,layout,head_size", LOWERING_CASES)
def test_kernels_lower_for_tpu(cache_dtype, layout, head_size):
  """Both kernels pass Pallas' Mosaic TPU lowering (what jit on a TPU runs before compiling);
  attention only for nvfp4 (its write is XLA's: the reference)."""
  spec = KVCacheSpec(2, head_size, 16, cache_dtype, layout)
  cache = jax.ShapeDtypeStruct(spec.physical_shape(64), spec.storage_dtype)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  ks = jnp.float32(0.5) if spec.codec.has_tensor_scales else None
  kv = jax.ShapeDtypeStruct((40, 2, head_size), spec.dtype)
  if mt.supports_write(spec) is None:
    text = _export_tpu(lambda c, k, v, s: mt.write_kv(c, k, v, s, spec, k_scale=ks, v_scale=ks),
                       cache, kv, kv, i32(40))
    assert "tpu_custom_call" in text
  q = jax.ShapeDtypeStruct((64, 8, head_size), jnp.bfloat16)
  for max_query_len in (1, 32):
    text = _export_tpu(
        lambda q, c, a, b, e: mt.ragged_paged_attention(
            q, c, spec, query_start_loc=a, seq_lens=b, block_table=e, scale=0.1,
            sliding_window=64, soft_cap=30.0, sinks=jnp.zeros(8), k_scale=ks, v_scale=ks,
            max_query_len=max_query_len),
        q, cache, i32(5), i32(4), i32(4, 8))
    assert "tpu_custom_call" in text
