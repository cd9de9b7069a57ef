"""A ragged attention batch on a poisoned cache, and a float64 numpy oracle of its output."""
import jax.numpy as jnp
import numpy as np

from kv_testing import jit_reference_read, jit_reference_write, nan_cache, random_kv


def build_batch(rng, spec, q_lens, prefix_lens, num_q_heads, pad_tokens=0, k_scale=None,
                v_scale=None, q_dtype=jnp.float32):
  """Random ragged batch written into a poisoned cache with random block tables.

  Every byte no sequence writes is 0xFF (NaN in every float format and as every float32
  scale), unused block-table entries are -1, pages are shuffled. Returns (q, cache, meta,
  k_f64, v_f64) where k/v are the dequantized per-sequence keys (float64 per sequence).
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
  cache = jit_reference_write(cache, key, value, jnp.asarray(slots), spec, k_scale, v_scale)
  k, v = jit_reference_read(cache, spec, jnp.asarray(slots), k_scale, v_scale)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  t = int(qsl[-1]) + pad_tokens
  q = jnp.asarray(rng.standard_normal((t, num_q_heads, spec.head_size)).astype(np.float32),
                  q_dtype)
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
