"""Unified (ragged prefill + decode) paged attention made of plain XLA ops: ``impl="xla"``.

The implementation ``auto`` takes where no kernel runs the call (the CPU, a platform with no
Pallas backend). Unlike the reference (:mod:`kvjax.reference.attention`, the oracle) it never
dequantizes the whole cache: a loop over key steps gathers, per row of queries, only the pages
its block table names for that step, dequantizes just those with the format's codec
(``spec.codec.dequantize``), and folds them into a flash-style online softmax. Temporary memory
is bounded by the batch (rows x queries x keys of one step), not by the cache.

Rows of queries are either the sequences (each with ``max_query_len`` query slots: decodes and
prefills with a known bound) or, where those slots would be many more than the tokens (a ragged
batch with no bound), the tokens themselves, a chunk of tokens at a time. Long rows of
sequences are attended a chunk of query slots at a time, so that under a causal mask each
chunk's key loop ends at its last position. Metadata outside the contract follows
:mod:`kvjax.ragged_batch`, as in every implementation. Like every implementation it computes on
the values as stored (the public op rotates around it).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import quant
from kvjax import ragged_batch as RB
from kvjax.spec import KVCacheSpec

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class XlaAttentionConfig:
  """Blocking of the XLA attention.

  Attributes:
    step_bytes: the float32 K and V one step dequantizes, over all rows attended together:
      each step takes as many whole pages a row as fit (at least one, at most the block-table
      width), so that a step's working set stays in the CPU's caches.
    max_slots_per_token: rows are the sequences (``max_query_len`` query slots each) while
      ``num_seqs * max_query_len <= max_slots_per_token * num_tokens``; else the tokens.
    tokens_per_chunk: tokens attended together when rows are tokens (a loop over chunks).
    query_chunk: with rows of more query slots than this, the slots are attended this many at
      a time (a loop over chunks), so that under a causal mask a chunk's key loop ends at its
      last position: about half the work of a long prefill.
  """
  step_bytes: int = 2 << 20
  max_slots_per_token: int = 4
  tokens_per_chunk: int = 16
  query_chunk: int = 256


DEFAULT_CONFIG = XlaAttentionConfig()


def _online_softmax(qg, pos, blocks, seq_lens, cache, spec, *, scale, causal, sliding_window,
                    soft_cap, sink_hg, k_scale, v_scale, step_bytes):
  """Attention of rows of query slots over their own pages.

  qg: float32 ``[R, Q, H, G, D]``; pos: int32 ``[R, Q]`` query positions; blocks: int32
  ``[R, M]`` page ids (in range); seq_lens: int32 ``[R]``. Returns float32 ``[R, Q, H, G, D]``,
  0 where a query sees no key.
  """
  r, nq, h, g, d = qg.shape
  n = spec.block_size
  max_blocks = blocks.shape[1]
  page_bytes = 2 * n * h * d * 4                                    # K and V, float32
  pages = max(1, min(max_blocks, step_bytes // (r * page_bytes)))  # pages a step
  num_steps = -(-max_blocks // pages)
  blocks = jnp.pad(blocks, ((0, 0), (0, num_steps * pages - max_blocks)))
  width = pages * n                                                # keys a step
  key_in_step = jnp.arange(width, dtype=jnp.int32)

  hi = jnp.minimum((jnp.max(seq_lens) + width - 1) // width, num_steps)
  if causal:                         # no query sees a key past max(pos)
    hi = jnp.minimum(hi, jnp.max(pos) // width + 1)
  lo = jnp.int32(0)
  if sliding_window is not None:     # no query sees a key at or below min(pos) - W
    lo = jnp.clip(jnp.min(pos) - sliding_window + 1, 0, None) // width
  lo = jnp.minimum(lo, hi)

  if sink_hg is None:
    m0 = jnp.full((r, nq, h, g), -jnp.inf, jnp.float32)
  else:                              # the sink: a key of logit sink and value 0
    m0 = jnp.broadcast_to(sink_hg, (r, nq, h, g))
  l0 = jnp.exp(m0 - jnp.where(jnp.isfinite(m0), m0, 0.0))
  acc0 = jnp.zeros((r, nq, h, g, d), jnp.float32)

  # The rows' pages, gathered once as bits (XLA:CPU computes a gather of 16-bit floats in
  # float32, and a gather inside the loop would carry the whole cache through it): [R, M', ...]
  # in the stored format, the batch's bytes and no more.
  row_pages = quant.to_bits(cache)[blocks]

  def step(j, carry):
    m, l, acc = carry
    bits_j = jax.lax.dynamic_slice_in_dim(row_pages, j * pages, pages, axis=1)
    pages_j = quant.from_bits(bits_j, cache.dtype)                           # [R, P, *page]
    k, v = spec.codec.dequantize(pages_j, spec, k_scale, v_scale)            # [R, P, N, H, D]
    k = k.astype(jnp.float32).reshape(r, width, h, d)   # float32 dots: XLA:CPU's fast path
    v = v.astype(jnp.float32).reshape(r, width, h, d)
    key = j * width + key_in_step
    valid = jnp.broadcast_to((key[None, :] < seq_lens[:, None])[:, None, :], (r, nq, width))
    if causal:
      valid &= key[None, None, :] <= pos[:, :, None]
    if sliding_window is not None:
      valid &= pos[:, :, None] - key[None, None, :] < sliding_window
    s = jnp.einsum("rqhgd,rkhd->rqhgk", qg, k, precision=_HI) * scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    vmask = valid[:, :, None, None, :]
    s = jnp.where(vmask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.where(vmask, jnp.exp(s - m_safe[..., None]), 0.0)
    # 0 * NaN of an unwritten slot would be NaN: V of keys no query of the row sees is 0
    v = jnp.where(jnp.any(valid, axis=1)[:, :, None, None], v, 0.0)
    pv = jnp.einsum("rqhgk,rkhd->rqhgd", p, v, precision=_HI)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

  _, l, acc = jax.lax.fori_loop(lo, hi, step, (m0, l0, acc0))
  return jnp.where((l > 0)[..., None], acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _by_query_chunks(attend, qg, pos, blocks, seq_lens, chunk: int):
  """``attend(qg, pos, blocks, seq_lens)`` (float32 ``[R, Q, H, G, D]``, positions ``[R, Q]``)
  over chunks of ``chunk`` query slots, one after another (``lax.map``): each chunk's key loop
  stops at its own last position. Padding slots repeat the last position (their rows are cut
  off)."""
  r, nq = pos.shape
  if nq <= chunk:
    return attend(qg, pos, blocks, seq_lens)
  nc = -(-nq // chunk)
  pad = nc * chunk - nq
  qg = jnp.pad(qg, ((0, 0), (0, pad)) + ((0, 0),) * 3)
  pos = jnp.pad(pos, ((0, 0), (0, pad)), mode="edge")
  split = lambda x: jnp.moveaxis(x.reshape((r, nc, chunk) + x.shape[2:]), 1, 0)
  out = jax.lax.map(lambda a: attend(a[0], a[1], blocks, seq_lens), (split(qg), split(pos)))
  return jnp.moveaxis(out, 0, 1).reshape((r, nc * chunk) + out.shape[3:])[:, :nq]


def unified_attention(q, cache, spec: KVCacheSpec, *, query_start_loc, seq_lens, block_table,
                      scale, causal=True, sliding_window=None, soft_cap=None, sinks=None,
                      k_scale=None, v_scale=None, max_query_len=None,
                      config: XlaAttentionConfig = DEFAULT_CONFIG):
  """Ragged paged attention over the packed cache, blocked over keys (module docstring).

  Arguments and result as :func:`kvjax.reference.attention.unified_attention`; ``config``:
  the blocking (:class:`XlaAttentionConfig`).
  """
  t, hq, d = q.shape
  h, n = spec.num_kv_heads, spec.block_size
  g = hq // h
  num_seqs, max_blocks = block_table.shape
  if t == 0 or num_seqs == 0:
    return jnp.zeros(q.shape, q.dtype)
  qsl, sl = RB.clamp_metadata(query_start_loc, seq_lens, num_tokens=t,
                              capacity=max_blocks * n)
  seq, pos, real = RB.token_positions(qsl, sl, t, max_query_len)
  blocks = RB.clamp_blocks(block_table, cache.shape[0])
  qf = q.astype(jnp.float32).reshape(t, h, g, d)
  attend = lambda qg, p, b, s, step_bytes=config.step_bytes: _online_softmax(
      qg, p, b, s, cache, spec, scale=scale, causal=causal, sliding_window=sliding_window,
      soft_cap=soft_cap, sink_hg=None if sinks is None else
      jnp.asarray(sinks, jnp.float32).reshape(h, g), k_scale=k_scale, v_scale=v_scale,
      step_bytes=step_bytes)

  slots = min(t, t if max_query_len is None else max(int(max_query_len), 1))
  if num_seqs * slots <= config.max_slots_per_token * t:
    # Rows are sequences: query slot i of sequence s is token qsl[s] + i.
    i = jnp.arange(slots, dtype=jnp.int32)
    q_len = qsl[1:] - qsl[:-1]
    tok = jnp.clip(qsl[:-1, None] + i[None, :], 0, t - 1)
    pos_s = sl[:, None] - q_len[:, None] + i[None, :]
    out = _by_query_chunks(attend, qf[tok], pos_s, blocks, sl, config.query_chunk)
    out = out[seq, jnp.clip(jnp.arange(t) - qsl[seq], 0, slots - 1)]
  else:
    # Rows are tokens, each over its sequence's pages: a chunk of tokens at a time.
    per_token = max(1, config.step_bytes // config.tokens_per_chunk)
    def one(args):                   # lax.map vmaps it over a chunk
      qi, pi, si = args
      return attend(qi[None, None], pi[None, None], blocks[si][None], sl[si][None],
                    per_token)[0, 0]
    out = jax.lax.map(one, (qf, pos, seq), batch_size=min(t, config.tokens_per_chunk))
  out = jnp.where(real[:, None, None, None], out, 0.0)
  return out.reshape(t, hq, d).astype(q.dtype)

