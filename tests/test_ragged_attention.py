"""Ragged paged attention kernel (pallas_kernels.ragged_attention) vs the reference, interpret mode.

Every batch mixes pure prefills (no cached prefix), chunked prefills on a cached
prefix, single-token decodes, an empty sequence and padding tokens at the end of
q. Pages no block table references are filled with 0xFF bytes (NaN in every
float format, NaN scales in per-token-head formats); slots past a sequence's
end inside its last page hold huge values. Padding rows must be exactly 0.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.reference import unified_attention as ref_attention
from kvjax.reference import write_kv
from pallas_kernels import ragged_schedule as sched
from pallas_kernels.triton.decode import paged_decode_attention
from pallas_kernels.triton.ragged import ragged_paged_attention
from pallas_kernels.triton.ragged_kernel import TileConfig

Q_LENS = (7, 1, 20, 0, 1, 12)
CTX_LENS = (0, 40, 17, 5, 0, 33)
PAD = 3


def _poisoned_batch(rng, spec, hq, q_lens=Q_LENS, ctx_lens=CTX_LENS, pad=PAD, k_scale=None,
                    v_scale=None):
  """(q, cache, query_start_loc, seq_lens, block_table) with shuffled, poisoned pages."""
  n = spec.block_size
  seq_lens = np.asarray(q_lens) + np.asarray(ctx_lens)
  pages = -(-seq_lens // n)
  num_blocks = int(pages.sum()) + 3
  perm = rng.permutation(num_blocks)
  bt = np.zeros((len(q_lens), int(pages.max()) + 1), np.int32)
  used = 0
  for s, p in enumerate(pages):
    bt[s, :p] = perm[used:used + p]
    bt[s, p:] = perm[used] if p else perm[0]   # unused entries name a real page, never poison
    used += p
  shape = spec.physical_shape(num_blocks)
  raw = np.full(int(np.prod(shape)) * spec.itemsize, 0xFF, np.uint8)
  cache = jnp.asarray(raw.view(spec.storage_dtype).reshape(shape))     # NaN everywhere
  slots = np.concatenate([bt[s, p // n] * n + p % n
                          for s, p in enumerate(np.arange(int(k) * n) for k in pages)])
  kv_shape = (len(slots), spec.num_kv_heads, spec.head_size)
  k = rng.standard_normal(kv_shape)
  v = rng.standard_normal(kv_shape)
  live = np.concatenate([np.arange(int(k_) * n) < L for k_, L in zip(pages, seq_lens)])
  k[~live] *= 1e4                                   # tails of last pages: huge, never visible
  v[~live] *= 1e4
  cache = write_kv(cache, jnp.asarray(k, spec.dtype), jnp.asarray(v, spec.dtype),
                   jnp.asarray(slots, jnp.int32), spec, k_scale=k_scale, v_scale=v_scale)
  t = int(np.sum(q_lens)) + pad
  q = jnp.asarray(rng.standard_normal((t, hq, spec.head_size)), spec.dtype)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q, cache, jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(bt)


def _run_both(rng, spec, group, *, max_query_len=None, k_scale=None, v_scale=None,
              tile_config=None, **kw):
  hq = spec.num_kv_heads * group
  q, cache, qsl, sl, bt = _poisoned_batch(rng, spec, hq, k_scale=k_scale, v_scale=v_scale)
  args = dict(scale=spec.head_size ** -0.5, k_scale=k_scale, v_scale=v_scale, **kw)

  @jax.jit
  def ours(q, cache, qsl, sl, bt):
    return ragged_paged_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                  block_table=bt, max_query_len=max_query_len, interpret=True,
                                  tile_config=tile_config, **args)

  out = ours(q, cache, qsl, sl, bt)
  assert out.shape == q.shape and out.dtype == q.dtype
  o = np.asarray(out, np.float32)
  r = _reference(q, cache, spec, qsl, sl, bt, **args)
  real = int(qsl[-1])
  assert np.all(o[real:] == 0), "padding tokens must output exactly 0"
  assert np.isfinite(r).all()
  return o, r


def _reference(q, cache, spec, qsl, sl, bt, **kw):
  """kvjax.reference.unified_attention, jitted (much faster to compile than eager), float32."""
  f = jax.jit(functools.partial(ref_attention, spec=spec, **kw))
  return np.asarray(f(q, cache, query_start_loc=qsl, seq_lens=sl, block_table=bt), np.float32)


def _close(o, r, dtype):
  tol = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 4e-3}.get(np.dtype(dtype), 2e-2)
  np.testing.assert_allclose(o, r, atol=tol, rtol=tol)


CASES = [
    # layout, cache_dtype, model dtype, G, D, N, extra kwargs
    ("NHD", "auto", jnp.bfloat16, 4, 64, 16, {}),
    ("HND", "auto", jnp.bfloat16, 7, 80, 32, dict(sliding_window=9)),
    ("NHD", "auto", jnp.bfloat16, 1, 128, 16, dict(soft_cap=4.0, sinks=True)),
    ("HND", "auto", jnp.bfloat16, 4, 64, 16, dict(causal=False, sliding_window=30)),
    ("NHD", "float32", jnp.float32, 2, 64, 16, dict(sliding_window=12, sinks=True,
                                                    max_query_len=max(Q_LENS))),
    ("HND", "float16", jnp.float16, 2, 128, 16, dict(max_query_len=64)),
]


@pytest.mark.parametrize("layout,cache_dtype,dtype,group,head_size,block_size,kw", CASES)
def test_ragged_matches_reference(rng, layout, cache_dtype, dtype, group, head_size, block_size,
                                  kw):
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=head_size, block_size=block_size,
                           layout=layout, cache_dtype=cache_dtype, dtype=dtype)
  kw = dict(kw)
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.asarray(rng.standard_normal(2 * group) * 2, jnp.float32)
  o, r = _run_both(rng, spec, group, **kw)
  _close(o, r, dtype)


@pytest.mark.parametrize("layout,cache_dtype,head_size,scales", [
    ("NHD", "fp8", 64, (0.5, 2.0)),
    ("HND", "fp8_e5m2", 64, ((0.5, 0.25), (2.0, 1.0))),
    ("NHD", "int8_per_token_head", 80, (None, None)),
    ("HND", "fp8_per_token_head", 64, (None, None)),
])
def test_ragged_quantized_caches(rng, layout, cache_dtype, head_size, scales):
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=head_size, block_size=16, layout=layout,
                           cache_dtype=cache_dtype, dtype=jnp.bfloat16)
  ks, vs = (None if s is None else jnp.asarray(s, jnp.float32) for s in scales)
  o, r = _run_both(rng, spec, 2, k_scale=ks, v_scale=vs)
  _close(o, r, jnp.bfloat16)


@pytest.mark.parametrize("layout,cache_dtype,group,head_size,block_size,kw", [
    ("NHD", "auto", 4, 64, 16, {}),
    ("HND", "int8_per_token_head", 7, 96, 32, dict(sliding_window=20, soft_cap=5.0)),
])
def test_gpu_prefill_tiles_match_reference(rng, layout, cache_dtype, group, head_size,
                                           block_size, kw):
  """The 256-row x 64-key tile the GPU uses for prefill buckets (interpret uses 32 rows)."""
  spec = kvjax.KVCacheSpec(num_kv_heads=1, head_size=head_size, block_size=block_size,
                           layout=layout, cache_dtype=cache_dtype, dtype=jnp.bfloat16)
  sinks = jnp.asarray(rng.standard_normal(group), jnp.float32)
  o, r = _run_both(rng, spec, group, tile_config=TileConfig(256, 64, 8, 3), sinks=sinks, **kw)
  _close(o, r, jnp.bfloat16)


def test_tile_schedule_covers_every_token_once(rng):
  """Every real query token lies in exactly one tile; the static bound is never short."""
  num_seqs, max_q = 6, 40
  for bq in (1, 3, 8, 16):
    nt = sched.num_tiles_bound(num_seqs * max_q, num_seqs, bq, max_q)
    schedule = jax.jit(sched.tile_schedule, static_argnums=(1, 2))
    for _ in range(4):
      q_lens = rng.integers(0, max_q + 1, num_seqs) * (rng.random(num_seqs) < 0.8)
      qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
      seq, q0 = (np.asarray(x) for x in schedule(jnp.asarray(qsl), nt, bq))
      seen = np.zeros(int(q_lens.sum()), int)
      for si, qi in zip(seq, q0):
        if qi != sched.EMPTY_TILE_Q0:
          start = int(qsl[si]) + qi
          seen[start:start + max(0, min(bq, int(q_lens[si]) - qi))] += 1
      assert np.all(seen == 1), (q_lens, bq)


SPLIT_CASES = [
    # layout, cache_dtype, G, D, N, (k_scale, v_scale), extra kwargs
    ("NHD", "int4_per_token_head", 1, 64, 16, (None, None), {}),
    ("HND", "int4_per_token_head", 4, 80, 16, (None, None),
     dict(sliding_window=9, soft_cap=4.0, sinks=True)),
    ("NHD", "int4_per_token_head", 5, 96, 32, (None, None), dict(max_query_len=32)),
    ("HND", "nvfp4", 2, 64, 16, (0.5, 2.0), {}),
    ("HND", "nvfp4", 4, 128, 16, (0.25, 1.5), dict(causal=False, sliding_window=30)),
    ("HND", "nvfp4", 1, 32, 16, (1.5, 0.75), {}),     # S = D/16 = 2: V scales stored linearly
]


@pytest.mark.parametrize("layout,cache_dtype,group,head_size,block_size,scales,kw", SPLIT_CASES)
def test_ragged_split_formats_match_reference(rng, layout, cache_dtype, group, head_size,
                                              block_size, scales, kw):
  """int4 per token-head and nvfp4 (even / odd head dims apart, decode's TileFormat)."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=head_size, block_size=block_size,
                           layout=layout, cache_dtype=cache_dtype, dtype=jnp.bfloat16)
  ks, vs = (None if x is None else jnp.asarray(x, jnp.float32) for x in scales)
  kw = dict(kw)
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.asarray(rng.standard_normal(2 * group) * 2, jnp.float32)
  o, r = _run_both(rng, spec, group, k_scale=ks, v_scale=vs, **kw)
  _close(o, r, jnp.bfloat16)


def test_split_format_gpu_prefill_tile_matches_reference(rng):
  """int4 through the 256-row x 64-key tile the GPU uses for prefill buckets."""
  spec = kvjax.KVCacheSpec(num_kv_heads=1, head_size=64, block_size=16, layout="HND",
                           cache_dtype="int4_per_token_head", dtype=jnp.bfloat16)
  o, r = _run_both(rng, spec, 4, tile_config=TileConfig(256, 64, 8, 3), sliding_window=20)
  _close(o, r, jnp.bfloat16)


def test_public_unified_attention_dispatches_here(rng):
  """kvjax.unified_attention(impl="pallas") runs this kernel for a mixed batch, under jit."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, layout="HND")
  q, cache, qsl, sl, bt = _poisoned_batch(rng, spec, 4)

  @jax.jit
  def f(q, cache, qsl, sl, bt):
    return kvjax.unified_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                   block_table=bt, scale=0.125, impl="pallas", max_query_len=20)

  out = np.asarray(f(q, cache, qsl, sl, bt), np.float32)
  ref = _reference(q, cache, spec, qsl, sl, bt, scale=0.125)
  _close(out, ref, jnp.bfloat16)
  assert np.all(out[int(qsl[-1]):] == 0)


# -- metadata outside the contract under jit: one rule for reference and kernels -----------
def _full_cache(rng, spec, num_blocks):
  """Every slot of every block written with random K/V (clamped block ids may read any)."""
  t = num_blocks * spec.block_size
  k, v = (jnp.asarray(rng.standard_normal((t, spec.num_kv_heads, spec.head_size)), spec.dtype)
          for _ in range(2))
  return write_kv(spec.allocate(num_blocks), k, v, jnp.arange(t, dtype=jnp.int32), spec)


def _three_ways(q, cache, spec, qsl, sl, bt, max_query_len, **kw):
  """(reference, ragged kernel, decode kernel or None) under jit with traced metadata."""
  def ref(q, c, qsl, sl, bt):
    return ref_attention(q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt,
                         max_query_len=max_query_len, **kw)

  def ragged(q, c, qsl, sl, bt):
    return ragged_paged_attention(q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt,
                                  max_query_len=max_query_len, interpret=True, **kw)

  def decode(q, c, qsl, sl, bt):
    return paged_decode_attention(q, c, spec, query_start_loc=qsl, seq_lens=sl,
                                  block_table=bt, interpret=True, **kw)

  outs = [np.asarray(jax.jit(f)(q, cache, qsl, sl, bt), np.float32) for f in (ref, ragged)]
  if max_query_len == 1 and q.shape[0] == sl.shape[0]:
    outs.append(np.asarray(jax.jit(decode)(q, cache, qsl, sl, bt), np.float32))
  return outs


# (query_start_loc, seq_lens, block-table fill, max_query_len) with T = 6, S = 4 (or T = S = 4)
INVALID_METADATA = [
    ([2, 3, 5, 6, 6], [4, 30, 9, 3], "ok", None),         # qsl[0] > 0: tokens 0, 1 output 0
    ([0, 4, 2, 5, 9], [8, 5, 7, 6], "ok", None),          # decreasing entry, end past T
    ([0, 2, 3, 4, 6], [-3, 1, 500, 6], "ok", None),       # negative / past-capacity seq_lens
    ([0, 1, 3, 4, 6], [20, 13, 9, 40], "wild", None),     # block ids < 0 and >= B
    ([0, 1, 4, 5, 6], [7, 9, 12, 5], "ok", 2),            # a sequence above max_query_len
    ([0, 1, 1, 2, 4], [9, 17, 33, 5], "ok", 1),           # decode batch, empty seq in between
    ([0, 1, 2, 2, 3], [9, 600, 33, -1], "wild", 1),       # decode batch, invalid everything
    ([1, 2, 3, 4, 4], [9, 17, 33, 5], "ok", 1),           # decode batch shifted by one
]


@pytest.mark.parametrize("qsl,seq_lens,table,max_query_len", INVALID_METADATA)
def test_metadata_outside_the_contract_gives_one_answer(rng, qsl, seq_lens, table,
                                                        max_query_len):
  """kvjax.ragged_batch's rules: the reference, the ragged and the decode kernel agree."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16, layout="HND")
  num_blocks, max_blocks = 6, 3
  cache = _full_cache(rng, spec, num_blocks)
  s = len(seq_lens)
  t = s if max_query_len == 1 else 6
  bt = rng.integers(0, num_blocks, (s, max_blocks))
  if table == "wild":
    bt[0, 0], bt[-1, -1], bt[1, 1] = -7, num_blocks + 3, 2**31 - 1
  q = jnp.asarray(rng.standard_normal((t, 4, 32)), jnp.bfloat16)
  outs = _three_ways(q, cache, spec, jnp.asarray(qsl, jnp.int32),
                     jnp.asarray(seq_lens, jnp.int32), jnp.asarray(bt, jnp.int32),
                     max_query_len, scale=0.2)
  assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
  for o in outs[1:]:
    _close(o, outs[0], jnp.bfloat16)


def test_decode_batch_with_an_empty_sequence_reads_the_right_rows(rng):
  """Valid concrete metadata: the second sequence has no query, so token 1 is the third
  sequence's query. The public op (decode kernel, max_query_len=1) gets it right."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16)
  cache = _full_cache(rng, spec, 6)
  q = jnp.asarray(rng.standard_normal((3, 4, 32)), jnp.bfloat16)
  meta = dict(query_start_loc=jnp.asarray([0, 1, 1, 2], jnp.int32),
              seq_lens=jnp.asarray([5, 17, 40], jnp.int32),
              block_table=jnp.asarray(rng.integers(0, 6, (3, 3)), jnp.int32))
  out = kvjax.unified_attention(q, cache, spec, scale=0.2, max_query_len=1, impl="pallas",
                                interpret=True, **meta)
  want = kvjax.unified_attention(q, cache, spec, scale=0.2, impl="reference", **meta)
  _close(np.asarray(out, np.float32), np.asarray(want, np.float32), jnp.bfloat16)
  assert not np.asarray(out)[2].any()          # token 2 belongs to no sequence


@pytest.mark.parametrize("max_query_len", [1, 8])
def test_traced_softmax_scale_in_the_kernels(rng, max_query_len):
  """jax.jit(kvjax.unified_attention) traces every argument, the softmax scale included."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16,
                           cache_dtype="fp8", layout="NHD")
  cache = _full_cache(rng, spec, 6)
  s = 3
  t = s if max_query_len == 1 else 8
  q = jnp.asarray(rng.standard_normal((t, 4, 32)), jnp.bfloat16)
  qsl = jnp.asarray([0, 1, 2, 3] if max_query_len == 1 else [0, 1, 6, 8], jnp.int32)
  sl = jnp.asarray([5, 30, 44], jnp.int32)
  bt = jnp.asarray(rng.integers(0, 6, (s, 3)), jnp.int32)

  @jax.jit
  def run(q, c, scale, ks):
    return kvjax.unified_attention(q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt,
                                   scale=scale, k_scale=ks, max_query_len=max_query_len,
                                   impl="pallas", interpret=True)

  out = np.asarray(run(q, cache, jnp.float32(0.3), jnp.float32(0.5)), np.float32)
  want = ref_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt,
                       scale=0.3, k_scale=0.5)
  _close(out, np.asarray(want, np.float32), jnp.bfloat16)


def test_jit_of_the_public_ops_needs_no_static_argnums(rng):
  """KVCacheSpec is a static pytree node: jax.jit of the public functions just works."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16)
  cache = spec.allocate(4)
  k, v = (jnp.asarray(rng.standard_normal((5, 2, 32)), jnp.bfloat16) for _ in range(2))
  slots = jnp.asarray([3, 20, 41, 60, 7], jnp.int32)
  cache = jax.jit(kvjax.write_kv)(cache, k, v, slots, spec)
  rk, _ = jax.jit(kvjax.read_kv)(cache, spec, slots)
  np.testing.assert_array_equal(np.asarray(rk), np.asarray(k, np.float32))
  q = jnp.asarray(rng.standard_normal((5, 4, 32)), jnp.bfloat16)
  meta = dict(query_start_loc=jnp.asarray([0, 2, 5], jnp.int32),
              seq_lens=jnp.asarray([2, 3], jnp.int32),
              block_table=jnp.asarray([[0, 1], [2, 3]], jnp.int32))
  out = jax.jit(kvjax.unified_attention)(q, cache, spec, scale=0.25, **meta)
  want = ref_attention(q, cache, spec, scale=0.25, **meta)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  assert jax.tree_util.tree_leaves(spec) == [] and hash(spec) == hash(
      kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16))
  mla = kvjax.MLACacheSpec()
  assert jax.tree_util.tree_leaves(mla) == [] and hash(mla) == hash(kvjax.MLACacheSpec())
