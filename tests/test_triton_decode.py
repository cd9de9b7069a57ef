"""What is particular to the Triton decode kernel: launch configs and KV splits, the
single-pass epilogue of split formats, large tiles, and the split rule.

The attention case suite (every format, every implementation) is test_op_attention.py.

The kernel reads a *poisoned* cache: every slot no sequence wrote holds NaN (float
caches) or random bytes with many 0xFF (byte caches, so scale slots decode to NaN),
and unused block-table entries point at poisoned or out-of-range blocks. The
reference reads a clean copy holding the same tokens (it would propagate NaN from
masked keys through 0 * NaN). Everything runs under ``jax.jit`` with traced
``seq_lens`` / ``block_table``.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import formats as F
from kvjax.reference import unified_attention as ref_attention
from pallas_kernels.triton.decode import paged_decode_attention
from pallas_kernels.triton.decode_config import DecodeConfig
from pallas_kernels.triton.tuning import choose_num_splits
from kv_testing import jit_reference_write
from op_suite import triton_interpret

INTERPRET = triton_interpret()   # interpret mode on CPU; compiled on a GPU


def _poisoned(rng, spec, num_blocks):
  shape = spec.physical_shape(num_blocks)
  if spec.format.kind == F.PLAIN:
    return jnp.full(shape, jnp.nan, spec.storage_dtype)
  raw = rng.integers(0, 256, int(np.prod(shape)) * spec.itemsize, dtype=np.uint8)
  raw[: raw.size // 4] = 0xFF
  return jnp.asarray(rng.permutation(raw).view(spec.storage_dtype).reshape(shape))


def _problem(rng, spec, lens, g, k_scale=None, v_scale=None):
  """q, poisoned cache, clean cache, seq_lens, block_table for a decode batch."""
  n = spec.block_size
  s = len(lens)
  m = max(1, max(-(-ln // n) for ln in lens)) + 1
  b = s * m + 2
  poison, clean = _poisoned(rng, spec, b), spec.allocate(b)
  table = rng.permutation(b)[: s * m].reshape(s, m)
  slots = []
  for i, ln in enumerate(lens):
    used = -(-ln // n)
    # unused entries: poisoned blocks, or out of range (must never be read)
    table[i, used:] = rng.choice([0, b - 1, b + 7, -3], m - used)
    slots += [table[i, p // n] * n + p % n for p in range(ln)]
  x = rng.standard_normal((2, len(slots), spec.num_kv_heads, spec.head_size)).astype(np.float32)
  x *= np.exp(rng.uniform(-1, 1, (2, len(slots), spec.num_kv_heads, 1)))
  k, v = (jnp.asarray(t).astype(spec.dtype) for t in x)
  slots = jnp.asarray(slots, jnp.int32)
  clean = jit_reference_write(clean, k, v, slots, spec, k_scale, v_scale)
  poison = jit_reference_write(poison, k, v, slots, spec, k_scale, v_scale)
  q = jnp.asarray(rng.standard_normal((s, spec.num_kv_heads * g, spec.head_size)), spec.dtype)
  return q, poison, clean, jnp.asarray(lens, jnp.int32), jnp.asarray(table, jnp.int32)


def _run(rng, cache_dtype, layout="NHD", *, h=2, g=4, d=64, n=16, lens=(1, 21, 70, 0),
         window=None, soft_cap=None, sinks=False, k_scale=None, v_scale=None, dtype=jnp.bfloat16,
         config=None):
  spec = kvjax.KVCacheSpec(num_kv_heads=h, head_size=d, block_size=n, cache_dtype=cache_dtype,
                           layout=layout, dtype=dtype)
  q, poison, clean, sl, bt = _problem(rng, spec, lens, g, k_scale, v_scale)
  sk = jnp.asarray(rng.standard_normal(h * g) * 2, jnp.float32) if sinks else None
  kw = dict(scale=d ** -0.5, sliding_window=window, soft_cap=soft_cap)

  @jax.jit
  def ours(q, cache, sl, bt, sk, ks, vs):
    return paged_decode_attention(q, cache, spec, seq_lens=sl, block_table=bt, sinks=sk,
                                  k_scale=ks, v_scale=vs, interpret=INTERPRET, config=config,
                                  **kw)

  out = ours(q, poison, sl, bt, sk, k_scale, v_scale)
  assert out.shape == q.shape and out.dtype == q.dtype
  ref = jax.jit(functools.partial(ref_attention, spec=spec, **kw))(   # jitted: one compile
      q, clean, query_start_loc=jnp.arange(len(lens) + 1, dtype=jnp.int32), seq_lens=sl,
      block_table=jnp.clip(bt, 0, clean.shape[0] - 1), sinks=sk, k_scale=k_scale,
      v_scale=v_scale)
  o = np.asarray(out.astype(jnp.float32))
  r = np.asarray(ref.astype(jnp.float32))
  assert np.isfinite(o).all(), "kernel output holds NaN/inf: it read a poisoned slot"
  for i, ln in enumerate(lens):
    if ln == 0:
      assert not np.any(o[i]), "a sequence with no keys must output 0"
  if np.dtype(dtype) == np.float32 and spec.storage_dtype == np.float32:
    tol = 1e-5
  elif np.dtype(dtype) == np.float16:
    tol = 4e-3
  else:
    tol = 2e-2  # bf16 q / output rounding, bf16 p in the p @ V dot
  scale = np.abs(r).max()
  err = np.abs(o - r)
  assert np.all(err <= tol * (np.abs(r) + scale)), (
      f"{cache_dtype} {layout}: max err {err.max():.3e} vs ref max {scale:.3e}")
  assert np.linalg.norm(o - r) <= tol * np.linalg.norm(r)
  return o


def test_bf16_mha_head96_block64_softcap(rng):
  _run(rng, "bfloat16", "HND", h=2, g=1, d=96, n=64, soft_cap=5.0, lens=(1, 70))


@pytest.mark.slow
def test_head256_block128_window(rng):
  _run(rng, "bfloat16", "NHD", h=1, g=4, d=256, n=128, window=100, lens=(129, 1, 250))


def test_int4_gqa7_head16_sinks(rng):
  # single pass: normalized and de-interleaved in the kernel's epilogue; D/2 = 8 data bytes
  # padded to the 16-wide tile
  _run(rng, "int4_per_token_head", "HND", h=1, g=7, d=16, n=32, sinks=True, lens=(1, 20),
       config=DecodeConfig(num_splits=1))


@pytest.mark.slow
def test_nvfp4_window_sinks_scale(rng):
  _run(rng, "nvfp4", "HND", h=1, g=4, d=64, window=40, sinks=True, k_scale=0.25, v_scale=0.5,
       lens=(1, 50), config=DecodeConfig(num_splits=1))


@pytest.mark.parametrize("config", [
    DecodeConfig(num_splits=1),
    pytest.param(DecodeConfig(tokens_per_step=16, num_splits=3), marks=pytest.mark.slow),
    DecodeConfig(prefetch=True, tokens_per_step=32, num_splits=2)])
def test_configs_agree(rng, config):
  _run(rng, "bfloat16", "NHD", lens=(1, 100, 0), window=60, config=config)


@pytest.mark.parametrize("cache_dtype,layout,splits,sinks", [
    ("bfloat16", "NHD", 3, True),
    ("int8_per_token_head", "HND", 4, False),
    pytest.param("fp8", "NHD", 7, True, marks=pytest.mark.slow)])
def test_splits_merged_in_kernel(rng, cache_dtype, layout, splits, sinks):
  """merge_in_kernel: the last split of each (sequence, head) merges every split's partials
  (splits with no keys, a sequence with none, sinks, a window) as the XLA merge would."""
  ks, vs = (0.5, 2.0) if cache_dtype == "fp8" else (None, None)
  _run(rng, cache_dtype, layout, lens=(1, 100, 0, 47), window=60, sinks=sinks, k_scale=ks,
       v_scale=vs, config=DecodeConfig(merge_in_kernel=True, tokens_per_step=16,
                                       num_splits=splits))


@pytest.mark.parametrize("cache_dtype,layout,n,tokens", [
    ("int8_per_token_head", "HND", 16, 64),     # 4 pages a step
    ("bfloat16", "NHD", 32, 32),                # one page a step
    pytest.param("int4_per_token_head", "NHD", 16, 32, marks=pytest.mark.slow),
    pytest.param("fp8", "HND", 48, 64, marks=pytest.mark.slow)])  # not whole pages: a key each
def test_block_ids_read_once_a_page(rng, cache_dtype, layout, n, tokens):
  """page_block_ids: a step's block ids read once a page (out-of-range and poisoned table
  entries past each sequence's pages, a window, two splits) agree with the reference."""
  per_tensor = kvjax.KVCacheSpec(2, 64, n, cache_dtype, layout=layout).format.has_tensor_scales
  ks, vs = (0.5, 2.0) if per_tensor else (None, None)
  _run(rng, cache_dtype, layout, n=n, lens=(1, 100, 0, 33), window=70, k_scale=ks, v_scale=vs,
       config=DecodeConfig(page_block_ids=True, tokens_per_step=tokens, num_splits=2))


@pytest.mark.parametrize("cache_dtype,layout,d,pairs", [
    ("fp8", "NHD", 64, True),
    ("int8_per_token_head", "HND", 80, True),
    pytest.param("fp8_e5m2", "HND", 64, True, marks=pytest.mark.slow),
    pytest.param("fp8_per_token_head", "NHD", 32, True, marks=pytest.mark.slow),
    pytest.param("fp8", "HND", 64, False, marks=pytest.mark.slow),
    ("int4_per_token_head", "NHD", 64, True),
    pytest.param("int4_per_token_head", "HND", 32, True, marks=pytest.mark.slow),
    pytest.param("int4_per_token_head", "HND", 64, False, marks=pytest.mark.slow),
    ("nvfp4", "HND", 64, True),
    pytest.param("nvfp4", "HND", 32, True, marks=pytest.mark.slow)])   # too narrow: bytes
def test_codes_as_words_or_bytes(rng, cache_dtype, layout, d, pairs):
  """pair_codes (uint16 words of two one-byte codes or four int4 / e2m1 codes, split into two
  or four head-dim parts) and byte tiles, vs the reference; with tensor scales where the
  format has them."""
  per_tensor = kvjax.KVCacheSpec(2, d, 16, cache_dtype, layout=layout).format.has_tensor_scales
  ks, vs = (0.5, 2.0) if per_tensor else (None, None)
  _run(rng, cache_dtype, layout, h=2, g=4, d=d, lens=(1, 40, 0, 17), k_scale=ks, v_scale=vs,
       config=DecodeConfig(pair_codes=pairs, num_splits=2))


@pytest.mark.parametrize("cache_dtype,layout,d,hooks", [
    ("fp8", "NHD", 128, "PairFormat"), ("int8_per_token_head", "HND", 80, "PairFormat"),
    ("int4_per_token_head", "NHD", 128, "Int4WordFormat"),
    ("int4_per_token_head", "HND", 32, "Int4WordFormat"),
    ("nvfp4", "HND", 64, "Nvfp4WordFormat"), ("nvfp4", "HND", 32, "Nvfp4Format"),
    ("bfloat16", "NHD", 128, "RowFormat")])
def test_decode_reads_codes_as_words_where_it_can(cache_dtype, layout, d, hooks):
  """The hooks pair_codes picks (what test_codes_as_words_or_bytes runs), and their parts."""
  from pallas_kernels.triton.adapters import tile_format
  spec = kvjax.KVCacheSpec(2, d, 16, cache_dtype, layout=layout)
  tf = tile_format(spec, jnp.bfloat16).paired(ptx=False)
  assert type(tf).__name__ == hooks
  cols = np.concatenate([np.asarray(c)[np.asarray(m)]
                         for c, m in (tf.part_cols(j) for j in range(tf.num_parts))])
  assert sorted(cols.tolist()) == list(range(d))       # every head dim in exactly one part


def test_bad_arguments_are_caught_before_the_kernel():
  """kvjax.unified_attention validates once; the kernel trusts what it gets."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16)
  cache = spec.allocate(4)
  q = jnp.ones((2, 4, 64), jnp.bfloat16)
  sl = jnp.array([1, 2], jnp.int32)
  bt = jnp.zeros((2, 2), jnp.int32)
  qsl = jnp.arange(3, dtype=jnp.int32)
  call = lambda **kw: kvjax.unified_attention(
      kw.pop("q", q), kw.pop("cache", cache), kw.pop("spec", spec),
      **{"query_start_loc": qsl, "seq_lens": sl, "block_table": bt, "scale": 0.1,
         "impl": "pallas", "interpret": INTERPRET, "max_query_len": 1, **kw})
  with pytest.raises(ValueError, match="head size"):
    call(q=jnp.ones((2, 4, 32), jnp.bfloat16))
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    call(q=jnp.ones((2, 3, 64), jnp.bfloat16))
  with pytest.raises(ValueError, match="disagree on S"):
    call(seq_lens=jnp.array([1, 2, 3], jnp.int32), block_table=jnp.zeros((3, 2), jnp.int32))
  with pytest.raises(TypeError, match="integer"):
    call(block_table=jnp.zeros((2, 2), jnp.float32))
  with pytest.raises(ValueError, match="sliding_window"):
    call(sliding_window=0)
  with pytest.raises(ValueError, match="soft_cap"):
    call(soft_cap=-1.0)
  with pytest.raises(ValueError, match="sinks"):
    call(sinks=jnp.zeros(3, jnp.float32))
  with pytest.raises(ValueError, match="physical shape"):
    call(cache=jnp.zeros((4, 16, 2, 64), jnp.bfloat16))
  fp8 = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, cache_dtype="fp8")
  with pytest.raises(ValueError, match="k_scale"):
    call(cache=fp8.allocate(4), spec=fp8, k_scale=jnp.ones(3))


def test_config_and_split_rule():
  with pytest.raises(ValueError):
    DecodeConfig(tokens_per_step=48)
  with pytest.raises(ValueError):
    DecodeConfig(num_splits=0)
  cfg = DecodeConfig(tokens_per_step=64, target_programs=1024)
  # few long sequences get many splits, capped by the steps of the longest sequence
  assert choose_num_splits(cfg, 8, 8, 2048, 16) == 16
  assert choose_num_splits(cfg, 1, 1, 8, 16) == 2
  assert choose_num_splits(cfg, 256, 8, 64, 16) == 1
  assert choose_num_splits(cfg, 64, 8, 4096, 16) == 1   # >= single_pass_programs: one pass
  assert choose_num_splits(cfg, 16, 8, 1024, 16) == 8
  assert choose_num_splits(DecodeConfig(num_splits=5), 1, 1, 1, 16) == 5
  assert DecodeConfig(tokens_per_step=16).step_tokens(64) == 64
