"""The Mosaic GPU ragged kernel compiled, in every variant it can be built in: each ``acc += P V``
form (``tiles.PV_VARIANTS``), each q / output staging (``tiles.STAGINGS``), persistent blocks
walking several work items, head sizes 128 and 256, one and two consumer warpgroups, float16,
pages of 48 tokens, quantized caches through the plain copy, and q tiles at every token offset
mod 8; each against ``kvjax.reference.unified_attention`` on a NaN-poisoned cache.

Compiled only (``KVJAX_TEST_COMPILED=1`` on an sm90+ GPU, tests/compiled_groups.py, group
"mosaic"): these batches are minutes each in Mosaic GPU interpret mode, whose numerics
test_mosaic_gpu.py covers on small cases.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kv_testing import nan_cache, shuffled_block_table
from op_suite import COMPILED, mosaic_gpu_numerics
from pallas_kernels.mosaic_gpu import tiles as TL
from pallas_kernels.mosaic_gpu.ragged_attention import ragged_paged_attention_tiled

pytestmark = pytest.mark.skipif(not COMPILED, reason="compiled Mosaic GPU only "
                                "(KVJAX_TEST_COMPILED=1 on an sm90+ GPU)")

#: A mix of prefills, prefixes, decodes, an empty sequence and 13 padding tokens (H=2, G=4).
MIX = ([300, 1, 1, 77, 0, 64], [0, 1000, 37, 500, 5, 64], 13)


def _batch(rng, spec, hq, q_lens, ctx_lens, pad, scale=None):
  """(q, cache, query_start_loc, seq_lens, block_table): shuffled pages, every byte no token
  was written to 0xFF (NaN), block-table entries past a sequence naming an unowned page."""
  n = spec.block_size
  seq_lens = np.asarray(q_lens) + np.asarray(ctx_lens)
  bt, num_blocks = shuffled_block_table(rng, -(-seq_lens // n), spare=3, unused="spare")
  slots = np.concatenate([bt[s, np.arange(L) // n] * n + np.arange(L) % n
                          for s, L in enumerate(seq_lens)]).astype(np.int32)
  kv_shape = (len(slots), spec.num_kv_heads, spec.head_size)
  k, v = (jnp.asarray(rng.standard_normal(kv_shape), spec.dtype) for _ in range(2))
  cache = kvjax.reference.write_kv(nan_cache(spec, num_blocks), k, v, jnp.asarray(slots), spec,
                                   k_scale=scale, v_scale=scale)
  q = jnp.asarray(rng.standard_normal((int(np.sum(q_lens)) + pad, hq, spec.head_size)),
                  spec.dtype)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q, cache, jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(bt)


def _check(rng, layout, h, group, head_size, block_size, q_lens, ctx_lens, pad,
           cache_dtype="auto", dtype=jnp.bfloat16, scale=None, **kw):
  """The kernel (``kw``: pv, staging, num_programs, window, soft cap, ...) vs the reference."""
  spec = kvjax.KVCacheSpec(h, head_size, block_size, cache_dtype, layout=layout, dtype=dtype)
  q, cache, qsl, sl, bt = _batch(rng, spec, h * group, q_lens, ctx_lens, pad, scale)
  opts = dict(scale=head_size ** -0.5, k_scale=scale, v_scale=scale)
  if kw.pop("sinks", False):
    opts["sinks"] = jnp.asarray(rng.standard_normal(h * group) * 2, jnp.float32)
  for name in ("sliding_window", "soft_cap", "causal"):
    if name in kw:
      opts[name] = kw.pop(name)
  out = ragged_paged_attention_tiled(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                     block_table=bt, max_query_len=max(q_lens), **opts, **kw)
  ref = jax.jit(functools.partial(kvjax.reference.unified_attention, spec=spec, **opts))(
      q, cache, query_start_loc=qsl, seq_lens=sl, block_table=bt)
  o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  real = int(qsl[-1])
  assert np.all(o[real:] == 0), "padding tokens must output exactly 0"
  assert np.isfinite(o).all() and np.isfinite(r).all()
  np.testing.assert_allclose(o, r, atol=2e-2 * np.abs(r).max(), rtol=2e-2)


@mosaic_gpu_numerics
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("pv", TL.PV_VARIANTS)
def test_every_pv_variant(rng, pv, layout):
  _check(rng, layout, 2, 4, 128, 16, *MIX, pv=pv)


@mosaic_gpu_numerics
@pytest.mark.parametrize("staging", TL.STAGINGS)
def test_every_staging_on_persistent_blocks(rng, staging):
  """Three CUDA blocks walk the batch's work items, so slots and barriers carry over."""
  _check(rng, "NHD", 2, 4, 128, 16, *MIX, staging=staging, num_programs=3)


@mosaic_gpu_numerics
@pytest.mark.parametrize("case", [
    pytest.param(("NHD", 2, 1, 128, 16, [700, 130, 1], [0, 300, 90], 5, {}), id="two-wgs-G1"),
    pytest.param(("NHD", 2, 4, 256, 16, [129, 1, 40], [0, 333, 7], 3, {}), id="D256"),
    pytest.param(("HND", 2, 7, 64, 32, [200, 1, 64, 3], [100, 700, 0, 90], 5,
                  dict(sliding_window=128, soft_cap=30.0, sinks=True)), id="G7-window-cap-sinks"),
    pytest.param(("NHD", 2, 8, 128, 16, [1] * 9, [0, 1, 15, 16, 17, 255, 1000, 3, 64], 7, {}),
                 id="decode-only-G8"),
    pytest.param(("HND", 2, 2, 128, 16, [90, 4], [40, 200], 2,
                  dict(causal=False, sliding_window=60)), id="non-causal-window"),
    pytest.param(("NHD", 2, 4, 64, 48, [100, 1], [50, 300], 4,
                  dict(dtype=jnp.float16, soft_cap=20.0)), id="fp16-N48"),
    pytest.param(("HND", 2, 4, 128, 16, [9, 10, 11, 12, 13, 14, 15, 17],
                  [0, 5, 0, 20, 3, 0, 40, 7], 3, {}), id="q-at-every-offset-mod-8"),
    pytest.param(("HND", 2, 4, 128, 16, [300, 1, 77], [0, 1000, 500], 5,
                  dict(cache_dtype="int8_per_token_head")), id="int8-plain-copy"),
    pytest.param(("NHD", 2, 4, 128, 16, [200, 1, 64], [30, 700, 0], 2,
                  dict(cache_dtype="fp8", scale=0.5)), id="fp8-plain-copy"),
])
def test_default_variant_on_each_shape(rng, case):
  *args, kw = case
  _check(rng, *args, **kw)
