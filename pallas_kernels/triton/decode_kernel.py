"""The Triton paged decode kernel over the packed cache (format-blind: per-format tile loads
and dequantization are the hooks of :mod:`pallas_kernels.triton.formats`).

One program per (sequence, KV head, split). A program walks its share of the
sequence's visible tokens in steps of T tokens (several pages): per step it
gathers the block ids of the T tokens from the block table, loads the K rows
and V rows of those tokens from the flat pages (K and V of a token in the same
step, so every cache line fetched is used), scores the padded query group
``[Gp, D]`` (read from q in the kernel, padding rows masked) against K with one
dot, updates an online softmax (base 2) and accumulates ``p @ V``. With one split it
normalizes in the kernel (sinks included) and writes the output directly; with
several it writes unnormalized partials (acc, running max m, sum l) that
:func:`pallas_kernels.common.merge_splits` combines (with the sinks) in XLA.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvjax import ragged_batch as RB
from pallas_kernels.common import next_pow2
from pallas_kernels.triton.decode_config import DecodeConfig
from pallas_kernels.triton.formats import TileFormat

#: Finite "minus infinity" for masked scores (avoids inf - inf = NaN).
NEG = -1e30
#: The online softmax runs in base 2 (scores times log2(e), ``exp2``): the multiply is folded
#: into the score scale, and ``exp2`` compiles to one ``ex2.approx.ftz`` where ``exp`` adds a
#: range reduction (sm_90 machine code: 82-142 fewer instructions a step, up to 12 fewer
#: registers a thread).
LOG2E = math.log2(math.e)


def _decode_kernel(q_ref, seq_ref, sl_ref, bt_ref, ts_ref, sink_ref, cache_ref, *refs,
                   tf: TileFormat, num_views: int, step_tokens: int, num_splits: int,
                   num_blocks: int, max_blocks: int, group_pad: int, scale, window, soft_cap,
                   has_sinks: bool, prefetch: bool, page_block_ids: bool):
  views, out_refs = refs[:num_views], refs[num_views:]
  s, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  t_step, n = step_tokens, tf.block_size
  gp, w = group_pad, tf.part_width
  num_groups = q_ref.shape[2]
  num_seqs = sl_ref.shape[0]
  # Query row s is the single query of sequence seq_ref[s] (num_seqs: of none, output 0);
  # its keys are the sequence's first seq_len, clipped to the block table's capacity.
  seq = seq_ref[s]
  seq_c = jnp.minimum(seq, num_seqs - 1)
  seq_len = jnp.where(seq < num_seqs, jnp.minimum(sl_ref[seq_c], max_blocks * n), 0)
  if scale is None:                 # a traced softmax scale rides along with the k/v scales
    scale = ts_ref[2, h]
  lo_tok = jnp.int32(0) if window is None else jnp.maximum(seq_len - window, 0)
  lo_step = lo_tok // t_step
  hi_step = (seq_len + t_step - 1) // t_step
  per = (jnp.maximum(hi_step - lo_step, 0) + num_splits - 1) // num_splits
  start = lo_step + split * per
  stop = jnp.minimum(start + per, hi_step)

  # The query group straight from q [S, H, G, D]: rows padded to Gp, head dim to W (masked).
  grow = jnp.arange(gp, dtype=jnp.int32)
  rows = grow < num_groups
  rows_c = jnp.minimum(grow, num_groups - 1)
  part_cols = [tf.part_cols(j) for j in range(tf.num_parts)]
  q_parts = []
  for cols, cmask in part_cols:
    cols_c = jnp.minimum(cols, tf.head_size - 1)
    idx = (s, h, jnp.broadcast_to(rows_c[:, None], (gp, w)),
           jnp.broadcast_to(cols_c[None, :], (gp, w)))
    qp = pltriton.load(q_ref.at[idx], mask=rows[:, None] & cmask[None, :], other=0.0)
    q_parts.append(tf.q_operand(qp))
  qsum = sum(jnp.sum(qp.astype(jnp.float32), axis=1) for qp in q_parts)
  k_scale = ts_ref[0, h]
  v_scale = ts_ref[1, h]
  iota = jnp.arange(t_step, dtype=jnp.int32)

  def visible(i):
    tok = i * t_step + iota
    return tok, (tok < seq_len) & (tok >= lo_tok)

  # tok >= 0: C-style lax.div / lax.rem (jnp's // and % add sign fix-ups per element)
  def block_ids(i):
    """int32 [T]: the block id of each key of step i (a load a key, or a load a page spread
    over its keys)."""
    if not page_block_ids or t_step % n:
      bidx = jnp.minimum(lax.div(i * t_step + iota, n), max_blocks - 1)
      return pltriton.load(bt_ref.at[(seq_c, bidx)])
    pages = t_step // n
    pidx = jnp.minimum(i * pages + jnp.arange(pages, dtype=jnp.int32), max_blocks - 1)
    per_page = pltriton.load(bt_ref.at[(seq_c, pidx)])
    return jnp.broadcast_to(per_page[:, None], (pages, n)).reshape(t_step)

  def load_step(i, in_range):
    tok, valid = visible(i)
    valid = valid & in_range
    blk = RB.clamp_blocks(block_ids(i), num_blocks)         # kvjax.ragged_batch rule 4
    return tf.load_kv(cache_ref, blk, lax.rem(tok, n), h, valid,
                      views)

  def update(i, tiles, m, l, accs):
    _, valid = visible(i)
    sc = tf.scores(q_parts, qsum, tiles, k_scale)
    if soft_cap is None:
      sc = sc * (scale * LOG2E)
    else:
      sc = (soft_cap * LOG2E) * jnp.tanh(sc * (scale / soft_cap))
    sc = jnp.where(valid[None, :], sc, NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(valid[None, :], jnp.exp2(sc - m_new[:, None]), 0.0)
    l_new = l * alpha + jnp.sum(p, axis=1)
    parts = tf.values(p, tiles, v_scale)
    accs = tuple(a * alpha[:, None] + o for a, o in zip(accs, parts))
    return m_new, l_new, accs

  m0 = jnp.full((gp,), NEG, jnp.float32)
  l0 = jnp.zeros((gp,), jnp.float32)
  accs0 = tuple(jnp.zeros((gp, w), jnp.float32) for _ in range(tf.num_parts))

  if prefetch:
    def body(i, carry):
      m, l, accs, tiles = carry
      nxt = load_step(i + 1, i + 1 < stop)
      m, l, accs = update(i, tiles, m, l, accs)
      return m, l, accs, nxt
    first = load_step(start, start < stop)
    m, l, accs, _ = lax.fori_loop(start, stop, body, (m0, l0, accs0, first))
  else:
    def body(i, carry):
      m, l, accs = carry
      return update(i, load_step(i, True), m, l, accs)
    m, l, accs = lax.fori_loop(start, stop, body, (m0, l0, accs0))

  if num_splits == 1:
    # Single pass: normalize here (sinks join the denominator) and write the padded group.
    (o_ref,) = out_refs
    if has_sinks:
      sk = pltriton.load(sink_ref.at[(h, rows_c)], mask=rows, other=0.0) * LOG2E
      m_f = jnp.maximum(m, sk)
      alpha = jnp.exp2(m - m_f)
      denom = l * alpha + jnp.exp2(sk - m_f)
    else:
      alpha, denom = jnp.ones_like(l), l
    coef = jnp.where(l > 0, alpha / jnp.where(l > 0, denom, 1.0), 0.0)
    for j, a in enumerate(accs):
      o_ref[:, j * w:(j + 1) * w] = (a * coef[:, None]).astype(o_ref.dtype)
    return
  # Split: unnormalized partials; only the real query rows go to memory.
  acc_ref, m_ref, l_ref = out_refs
  for j, a in enumerate(accs):
    pltriton.store(acc_ref.at[:, j * w:(j + 1) * w], a, mask=rows[:, None])
  pltriton.store(m_ref.at[:], m * (1.0 / LOG2E), mask=rows)    # natural log, as merged
  pltriton.store(l_ref.at[:], l, mask=rows)


@functools.partial(jax.jit, static_argnames=("tf", "config", "num_splits", "scale", "window",
                                             "soft_cap", "has_sinks", "interpret"))
def decode_call(q, seq_of_row, seq_lens, block_table, tensor_scales, sinks, pages, views=(),
                *,
                tf: TileFormat, config: DecodeConfig, num_splits: int, scale, window, soft_cap,
                has_sinks: bool, interpret: bool):
  """Run the kernel.

  Args:
    q: ``[S, H, G, D]`` (a free reshape of ``[S, Hq, D]``), any float dtype.
    seq_of_row: int32 ``[S]``: the sequence whose query each row of q is (S: none, row 0).
    seq_lens: int32 ``[S]``; block_table: int32 ``[S, M]``.
    tensor_scales: float32 ``[2, H]`` (k, v global scales; ones when unused), or ``[3, H]``
      with the softmax scale in row 2 when ``scale`` is None (traced).
    sinks: float32 ``[H, G]`` sink logits (read only when ``has_sinks``).
    pages: the cache as ``[B, page_elems]`` (a free reshape of the physical array).
    views: the same pages viewed as each of the format's :meth:`TileFormat.view_dtypes`
      (float32 words ``[B, page_elems / 4]`` for row scales, uint16 pairs ``[B, page_elems
      / 2]`` for the formats' word hooks, :class:`~pallas_kernels.triton.formats.WordRows`).
  Returns:
    ``num_splits == 1``: the normalized output ``[S, H, Gp, parts * W]`` in q's dtype
    (rows past G and columns past the head size are padding).
    Otherwise unnormalized partials: acc float32 ``[S, H, splits, Gp, parts * W]`` (part
    ``j`` of a split format holds head dims ``parts * i + j``), m (natural log) and l float32
    ``[S, H, splits, Gp]``; only the first G rows of the Gp axis are written.
  """
  num_seqs, num_heads, num_groups, head_size = q.shape
  gp = max(16, next_pow2(num_groups))
  qw = tf.num_parts * tf.part_width
  kernel = functools.partial(
      _decode_kernel, tf=tf, step_tokens=config.step_tokens(tf.block_size),
      num_splits=num_splits, num_blocks=pages.shape[0], max_blocks=block_table.shape[1],
      group_pad=gp, scale=scale, window=window, soft_cap=soft_cap, has_sinks=has_sinks,
      prefetch=config.prefetch, page_block_ids=config.page_block_ids, num_views=len(views))
  whole = pl.BlockSpec(memory_space=pl.ANY)
  f32 = jnp.float32
  if num_splits == 1:
    out_shape = jax.ShapeDtypeStruct((num_seqs, num_heads, gp, qw), q.dtype)
    out_specs = pl.BlockSpec((None, None, gp, qw), lambda s, h, k: (s, h, 0, 0))
  else:
    row_spec = pl.BlockSpec((None, None, None, gp), lambda s, h, k: (s, h, k, 0))
    out_shape = (
        jax.ShapeDtypeStruct((num_seqs, num_heads, num_splits, gp, qw), f32),
        jax.ShapeDtypeStruct((num_seqs, num_heads, num_splits, gp), f32),
        jax.ShapeDtypeStruct((num_seqs, num_heads, num_splits, gp), f32),
    )
    out_specs = [pl.BlockSpec((None, None, None, gp, qw), lambda s, h, k: (s, h, k, 0, 0)),
                 row_spec, row_spec]
  return pl.pallas_call(
      kernel,
      grid=(num_seqs, num_heads, num_splits),
      in_specs=[whole] * (7 + len(views)),
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="kvjax_paged_decode",
  )(q, seq_of_row, seq_lens, block_table, tensor_scales, sinks, pages, *views)
