"""The reference attention (the oracle) against a plain float64 numpy loop, and legacy 5-D."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kv_testing import nan_cache, random_kv, spec_for


def build_batch(rng, spec, q_lens, prefix_lens, num_q_heads, pad_tokens=0, k_scale=None):
  """Random ragged batch written into a fresh cache with random block tables.

  Returns (q, cache, meta, k_f64, v_f64) where k/v are the dequantized per-sequence keys.
  """
  n = spec.block_size
  seq_lens = np.asarray(q_lens) + np.asarray(prefix_lens)
  blocks_per_seq = [-(-int(s) // n) for s in seq_lens]
  max_blocks = max(blocks_per_seq) + 1
  num_blocks = sum(blocks_per_seq) + 3                 # spare pages, never referenced
  perm = rng.permutation(num_blocks)
  block_table = np.full((len(q_lens), max_blocks), -1, np.int32)
  cursor = 0
  slots = []
  for i, nb in enumerate(blocks_per_seq):
    block_table[i, :nb] = perm[cursor:cursor + nb]
    cursor += nb
    pos = np.arange(seq_lens[i])
    slots.append(block_table[i, pos // n] * n + pos % n)
  slots = np.concatenate(slots).astype(np.int32)
  # Unwritten slots hold NaN-ish garbage: masked keys must never reach the output.
  cache = nan_cache(spec, num_blocks)
  key, value = random_kv(rng, spec, len(slots))
  cache = kvjax.write_kv(cache, key, value, jnp.asarray(slots), spec, k_scale=k_scale,
                         v_scale=k_scale, impl="reference")
  k, v = kvjax.read_kv(cache, spec, jnp.asarray(slots), k_scale=k_scale, v_scale=k_scale)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  t = int(qsl[-1]) + pad_tokens
  q = jnp.asarray(rng.standard_normal((t, num_q_heads, spec.head_size)).astype(np.float32))
  meta = dict(query_start_loc=jnp.asarray(qsl), seq_lens=jnp.asarray(seq_lens, jnp.int32),
              block_table=jnp.asarray(block_table))
  starts = np.concatenate([[0], np.cumsum(seq_lens)])
  ks = [np.asarray(k[starts[i]:starts[i + 1]], np.float64) for i in range(len(q_lens))]
  vs = [np.asarray(v[starts[i]:starts[i + 1]], np.float64) for i in range(len(q_lens))]
  return q, cache, meta, ks, vs


def numpy_attention(q, meta, ks, vs, *, scale, causal=True, window=None, soft_cap=None,
                    sinks=None):
  q = np.asarray(q, np.float64)
  t, hq, d = q.shape
  out = np.zeros_like(q)
  qsl = np.asarray(meta["query_start_loc"])
  seq_lens = np.asarray(meta["seq_lens"])
  for s in range(len(seq_lens)):
    k, v = ks[s], vs[s]
    h = k.shape[1]
    g = hq // h
    q_len = qsl[s + 1] - qsl[s]
    for i in range(q_len):
      pos = seq_lens[s] - q_len + i
      for head in range(hq):
        kv = head // g
        sc = scale * k[:, kv] @ q[qsl[s] + i, head]
        if soft_cap is not None:
          sc = soft_cap * np.tanh(sc / soft_cap)
        keys = np.arange(seq_lens[s])
        mask = np.ones_like(keys, bool)
        if causal:
          mask &= keys <= pos
        if window is not None:
          mask &= pos - keys < window
        if not mask.any():
          continue
        logits = sc[mask]
        m = logits.max() if sinks is None else max(logits.max(), sinks[head])
        p = np.exp(logits - m)
        denom = p.sum() + (0 if sinks is None else np.exp(sinks[head] - m))
        out[qsl[s] + i, head] = p @ v[mask, kv] / denom
  return out


@pytest.mark.parametrize("layout,cache_dtype,g,window,soft_cap,use_sinks", [
    ("NHD", "bfloat16", 4, None, None, False),
    ("HND", "float32", 1, 5, None, True),
    ("NHD", "int8_per_token_head", 7, None, 20.0, False),
    ("HND", "fp8", 2, 9, 10.0, True),
    ("HND", "nvfp4", 3, None, None, False),
    ("NHD", "int4_per_token_head", 2, None, None, True),
])
def test_reference_matches_numpy(rng, layout, cache_dtype, g, window, soft_cap, use_sinks):
  spec = spec_for(cache_dtype, layout, num_kv_heads=2, head_size=32)
  q_lens = [1, 5, 17, 1]
  prefix = [0, 0, 23, 40]
  ks = 0.5 if spec.format.has_tensor_scales else None
  q, cache, meta, kk, vv = build_batch(rng, spec, q_lens, prefix, 2 * g, pad_tokens=3,
                                       k_scale=ks)
  sinks = rng.standard_normal(2 * g).astype(np.float32) if use_sinks else None
  scale = 1 / np.sqrt(32)
  out = kvjax.reference.unified_attention(
      q, cache, spec, scale=scale, sliding_window=window, soft_cap=soft_cap,
      sinks=None if sinks is None else jnp.asarray(sinks), k_scale=ks, v_scale=ks, **meta)
  expect = numpy_attention(q, meta, kk, vv, scale=scale, window=window, soft_cap=soft_cap,
                           sinks=sinks)
  np.testing.assert_allclose(np.asarray(out), expect, rtol=2e-5, atol=2e-5)
  assert not np.asarray(out)[-3:].any(), "padding tokens must output 0"


def test_public_entry_defaults_to_reference_on_cpu_and_validates(rng):
  spec = spec_for("bfloat16", num_kv_heads=2, head_size=32)
  q, cache, meta, kk, vv = build_batch(rng, spec, [3, 1], [4, 9], 4)
  out = jax.jit(lambda q, c, m: kvjax.unified_attention(q, c, spec, scale=0.2, **m))(q, cache,
                                                                                  meta)
  expect = numpy_attention(q, meta, kk, vv, scale=0.2)
  np.testing.assert_allclose(np.asarray(out), expect, rtol=2e-5, atol=2e-5)
  bad = [
      (dict(q=q[:, :3]), ValueError, "multiple of num_kv_heads"),
      (dict(q=q[..., :16]), ValueError, "head size"),
      (dict(seq_lens=meta["seq_lens"][:1]), ValueError, "disagree"),
      (dict(sliding_window=0), ValueError, "sliding_window"),
      (dict(sinks=jnp.zeros(3)), ValueError, "sinks"),
      (dict(seq_lens=meta["seq_lens"] + 1000), ValueError, "capacity"),
      (dict(impl="cuda"), ValueError, "impl"),
      (dict(max_query_len=2), ValueError, "max_query_len"),
  ]
  for override, err, match in bad:
    args = dict(q=q, cache=cache, spec=spec, scale=0.2, **meta)
    args.update(override)
    with pytest.raises(err, match=match):
      kvjax.unified_attention(**args)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_legacy_5d_roundtrip(rng, layout):
  spec = spec_for("bfloat16", layout, num_kv_heads=3, head_size=32)
  legacy = jnp.asarray(rng.standard_normal((4, 2, 16, 3, 32)).astype(np.float32), jnp.bfloat16)
  packed = kvjax.from_legacy_5d(legacy, spec)
  assert packed.shape == spec.physical_shape(4)
  k, v = kvjax.kv_views(packed, spec)
  np.testing.assert_array_equal(np.asarray(k), np.asarray(legacy[:, 0]))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(legacy[:, 1]))
  np.testing.assert_array_equal(np.asarray(kvjax.to_legacy_5d(packed, spec)), np.asarray(legacy))
  with pytest.raises(ValueError, match="legacy"):
    kvjax.from_legacy_5d(legacy[:, :1], spec)
  with pytest.raises(ValueError, match="scales"):
    kvjax.from_legacy_5d(legacy, spec_for("int8_per_token_head"))


def test_auto_on_gpu_runs_ragged_kernel_for_int4(rng, monkeypatch):
  """impl="auto" on a GPU backend sends a ragged batch (an int4 cache here) to the ragged
  Pallas kernel (in interpret mode), not the reference, and matches the numpy oracle."""
  from kvjax import registry
  from pallas_kernels.triton import ragged as ragged_attention
  calls = []
  kernel = ragged_attention.ragged_paged_attention

  def spy(*args, **kwargs):
    calls.append(kwargs.get("interpret"))
    return kernel(*args, **kwargs)

  monkeypatch.setattr(ragged_attention, "ragged_paged_attention", spy)
  spec = spec_for("int4_per_token_head", num_kv_heads=2, head_size=32)
  q, cache, meta, kk, vv = build_batch(rng, spec, [3, 1], [4, 9], 4)
  monkeypatch.setattr(registry, "platform", lambda: "gpu")
  out = kvjax.unified_attention(q, cache, spec, scale=0.2, interpret=True, **meta)
  assert calls == [True]
  np.testing.assert_allclose(np.asarray(out), numpy_attention(q, meta, kk, vv, scale=0.2),
                             rtol=2e-5, atol=2e-5)
