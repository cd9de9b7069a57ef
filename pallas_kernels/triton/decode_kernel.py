"""The Triton paged decode kernel over the packed cache (format-blind: per-format tile loads
and dequantization are the hooks of :mod:`pallas_kernels.triton.formats`).

One program per (sequence, KV head, split). A program walks its share of the
sequence's visible tokens in steps of T tokens (several pages): per step it
gathers the block ids of the T tokens from the block table, loads the K rows
and V rows of those tokens from the flat pages (K and V of a token in the same
step, so every cache line fetched is used), scores the padded query group
``[Gp, D]`` (read from q in the kernel, padding rows masked) against K with one
dot, updates an online softmax (base 2) and accumulates ``p @ V``. With one split it
normalizes in the kernel (sinks included) and writes the output directly, in q's shape
``[S, H, G, D]``; with several it writes unnormalized partials (acc, running max m, sum l),
which the split that finishes a (sequence, head) last merges into the output
(``DecodeConfig.merge_in_kernel``: an atomic counter a pair), or
:func:`pallas_kernels.common.merge_splits` combines in XLA after the kernel.
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
                   has_sinks: bool, prefetch: bool, page_block_ids: bool, merge_in_kernel: bool,
                   interpret: bool):
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

  def group_part(j, clip=True):
    """(index, mask) of the query group's part j in a ``[S, H, G, D]`` array: ``[Gp, W]``.
    Masked entries point at the last row / column (clip), or past the end: a store in
    interpret mode writes masked entries back, and past the end it drops them."""
    cols, cmask = tf.part_cols(j)
    r, c = (rows_c, jnp.minimum(cols, tf.head_size - 1)) if clip else (grow, cols)
    idx = (s, h, jnp.broadcast_to(r[:, None], (gp, w)), jnp.broadcast_to(c[None, :], (gp, w)))
    return idx, rows[:, None] & cmask[None, :]

  q_parts = []
  for j in range(tf.num_parts):
    idx, mask = group_part(j)
    q_parts.append(tf.q_operand(pltriton.load(q_ref.at[idx], mask=mask, other=0.0)))
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

  def finish(o_ref, m, l, accs):
    """Normalize (sinks join the denominator) and write the group's rows of o ``[S, H, G, D]``
    (each part to its head-dim columns)."""
    if has_sinks:
      sk = pltriton.load(sink_ref.at[(h, rows_c)], mask=rows, other=0.0) * LOG2E
      m_f = jnp.maximum(m, sk)
      alpha = jnp.exp2(m - m_f)
      denom = l * alpha + jnp.exp2(sk - m_f)
    else:
      alpha, denom = jnp.ones_like(l), l
    coef = jnp.where(l > 0, alpha / jnp.where(l > 0, denom, 1.0), 0.0)
    for j, a in enumerate(accs):
      idx, mask = group_part(j, clip=False)
      pltriton.store(o_ref.at[idx], (a * coef[:, None]).astype(o_ref.dtype), mask=mask)

  if num_splits == 1:
    (o_ref,) = out_refs
    finish(o_ref, m, l, accs)
    return
  # Split: unnormalized partials of this split; only the real query rows go to memory.
  if merge_in_kernel:
    count_ref, o_ref, acc_ref, m_ref, l_ref, _ = out_refs   # count_ref: input, aliased last
  else:
    acc_ref, m_ref, l_ref = out_refs
  for j, a in enumerate(accs):
    pltriton.store(acc_ref.at[s, h, split, :, pl.ds(j * w, w)], a, mask=rows[:, None])
  pltriton.store(m_ref.at[s, h, split], m * (1.0 / LOG2E), mask=rows)  # natural log, as merged
  pltriton.store(l_ref.at[s, h, split], l, mask=rows)
  if not merge_in_kernel:
    return
  # The split that finishes its (sequence, head) last merges all partials. The barrier orders
  # every thread's stores before the counter's acquire-release increment (one thread), as a
  # grid-wide sync does; the last split reads the others' partials past L1 (volatile loads).
  if not interpret:                  # (the interpreter runs one program at a time)
    pltriton.debug_barrier()
  done_before = pltriton.atomic_add(count_ref, (s, h), jnp.int32(1))

  @pl.when(done_before == num_splits - 1)
  def _merge():
    def merge_split(k, carry):
      m, l, accs = carry
      load = functools.partial(pltriton.load, volatile=True)
      m_k = load(m_ref.at[s, h, k], mask=rows, other=NEG) * LOG2E
      l_k = load(l_ref.at[s, h, k], mask=rows, other=0.0)
      m_new = jnp.maximum(m, m_k)
      alpha, beta = jnp.exp2(m - m_new), jnp.exp2(m_k - m_new)
      accs = tuple(
          a * alpha[:, None]
          + load(acc_ref.at[s, h, k, :, pl.ds(j * w, w)], mask=rows[:, None], other=0.0)
          * beta[:, None]
          for j, a in enumerate(accs))
      return m_new, l * alpha + l_k * beta, accs
    finish(o_ref, *lax.fori_loop(0, num_splits, merge_split, (m0, l0, accs0)))


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
    ``num_splits == 1`` or ``config.merge_in_kernel``: the normalized output ``[S, H, G, D]``
    in q's dtype.
    Otherwise unnormalized partials: acc float32 ``[S, H, splits, Gp, parts * W]`` (part
    ``j`` of a split format holds head dims ``parts * i + j``), m (natural log) and l float32
    ``[S, H, splits, Gp]``; only the first G rows of the Gp axis are written.
  """
  num_seqs, num_heads, num_groups, head_size = q.shape
  gp = max(16, next_pow2(num_groups))
  qw = tf.num_parts * tf.part_width
  merge = config.merge_in_kernel and num_splits > 1
  kernel = functools.partial(
      _decode_kernel, tf=tf, step_tokens=config.step_tokens(tf.block_size),
      num_splits=num_splits, num_blocks=pages.shape[0], max_blocks=block_table.shape[1],
      group_pad=gp, scale=scale, window=window, soft_cap=soft_cap, has_sinks=has_sinks,
      prefetch=config.prefetch, page_block_ids=config.page_block_ids, num_views=len(views),
      merge_in_kernel=merge, interpret=interpret)
  whole = pl.BlockSpec(memory_space=pl.ANY)
  f32 = jnp.float32
  writes_output = num_splits == 1 or merge
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)] if writes_output else []
  if num_splits > 1:
    out_shape += [jax.ShapeDtypeStruct((num_seqs, num_heads, num_splits, gp, qw), f32),
                  jax.ShapeDtypeStruct((num_seqs, num_heads, num_splits, gp), f32),
                  jax.ShapeDtypeStruct((num_seqs, num_heads, num_splits, gp), f32)]
  inputs = [q, seq_of_row, seq_lens, block_table, tensor_scales, sinks, pages, *views]
  aliases = {}
  if merge:           # splits done a (sequence, head), counted up from 0; the counter is aliased
    aliases = {len(inputs): len(out_shape)}
    inputs.append(jnp.zeros((num_seqs, num_heads), jnp.int32))
    out_shape.append(jax.ShapeDtypeStruct((num_seqs, num_heads), jnp.int32))
  res = pl.pallas_call(
      kernel,
      grid=(num_seqs, num_heads, num_splits),
      in_specs=[whole] * len(inputs),
      out_specs=[whole] * len(out_shape),
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=pltriton.CompilerParams(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="kvjax_paged_decode",
  )(*inputs)
  return res[0] if writes_output else tuple(res)
