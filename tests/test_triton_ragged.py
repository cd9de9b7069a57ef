"""What is particular to the Triton ragged kernel: the GPU's prefill tiles (256 rows x 64
keys, in interpret mode) and the tile schedule.

The attention case suite (every format, every implementation) is test_op_attention.py.

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
from pallas_kernels import ragged_schedule as sched
from pallas_kernels.triton.ragged import ragged_paged_attention
from pallas_kernels.triton.ragged_kernel import TileConfig
from kv_testing import poisoned_ragged_batch
from op_suite import triton_interpret

INTERPRET = triton_interpret()   # interpret mode on CPU; compiled on a GPU


def _run_both(rng, spec, group, *, max_query_len=None, k_scale=None, v_scale=None,
              tile_config=None, **kw):
  hq = spec.num_kv_heads * group
  q, cache, qsl, sl, bt = poisoned_ragged_batch(rng, spec, hq, k_scale=k_scale, v_scale=v_scale)
  args = dict(scale=spec.head_size ** -0.5, k_scale=k_scale, v_scale=v_scale, **kw)

  @jax.jit
  def ours(q, cache, qsl, sl, bt):
    return ragged_paged_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                  block_table=bt, max_query_len=max_query_len,
                                  interpret=INTERPRET, tile_config=tile_config, **args)

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


def test_tile_schedule_lowers_without_a_loop():
  """The schedule is straight-line XLA: a while loop (jnp.searchsorted's default) cost 48-94 µs
  of small kernels and launch gaps a call on the H200."""
  schedule = jax.jit(sched.tile_schedule, static_argnums=(1, 2))
  text = schedule.lower(jnp.zeros(17, jnp.int32), 529, 32).as_text()
  assert "stablehlo.while" not in text and "stablehlo.case" not in text


def test_split_format_gpu_prefill_tile_matches_reference(rng):
  """int4 through the 256-row x 64-key tile the GPU uses for prefill buckets."""
  spec = kvjax.KVCacheSpec(num_kv_heads=1, head_size=64, block_size=16, layout="HND",
                           cache_dtype="int4_per_token_head", dtype=jnp.bfloat16)
  o, r = _run_both(rng, spec, 4, tile_config=TileConfig(256, 64, 8, 3), sliding_window=20)
  _close(o, r, jnp.bfloat16)
