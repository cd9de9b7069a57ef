"""Mosaic TPU ragged paged attention over the packed cache (docs/layout.md §6).

Entry point :func:`ragged_paged_attention` (inputs already validated by
``kvjax.unified_attention``): prefills with a cached prefix and decodes in one ragged batch,
GQA of any ratio, causal, sliding window, soft cap, sinks; padding tokens and rows with no
visible key give 0; metadata outside the contract follows :mod:`kvjax.ragged_batch`. Formats
the adapter table has no row hooks for (nvfp4) are read through a plain copy of the batch's
pages (:mod:`kvjax.plain_copy`).

Plan (details and numbers in docs/tpu.md). One grid program per query tile
(:mod:`pallas_kernels.mosaic_tpu.tiles`: up to ``bq`` tokens of one sequence x the G query
heads of each KV head), for all KV heads. The program walks its sequence's visible keys in
steps of P pages: per step it DMAs whole pages ``cache[block]`` (NHD ``(N, H, C)``, HND
``(H, N, C)``: K and V of every head in one copy) from HBM into one half of a VMEM double
buffer while it computes on the other half. Block ids come from the block table,
scalar-prefetched into SMEM with the per-tile metadata. Per KV head the K and V lanes of the
tile are decoded (fp8 per-tensor scales are folded into the scores and the output instead),
scores and P·V go through the MXU with float32 accumulation, and an online softmax keeps
running max / sum / accumulator in VMEM scratch. Masked scores are selected away (never
added), and V rows outside the fetched key range are zeroed, so unwritten or stale bytes
(NaN included) never reach the output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax import plain_copy as PC
from kvjax import ragged_batch as RB
from kvjax.spec import KVCacheSpec
from pallas_kernels.mosaic_tpu import tiles as TL
from pallas_kernels.mosaic_tpu.adapters import SUPPORTED_Q_DTYPES, rows_of, unsupported_reason
from pallas_kernels.mosaic_tpu.rows import Rows, halves_order
from pallas_kernels.mosaic_tpu.interpret import interpret_params

_LANES = 128
_HIGHEST = jax.lax.Precision.HIGHEST


def supports_attention(spec, q_dtype) -> str | None:
  """None when :func:`ragged_paged_attention` handles ``spec`` and ``q_dtype``, else a reason.

  Every KV cache format: those the adapter table reads in the kernel, the others (nvfp4)
  through a plain copy of the batch's pages (:func:`reads_a_plain_copy`)."""
  if not isinstance(spec, KVCacheSpec):
    return unsupported_reason(spec)
  if np.dtype(q_dtype) not in SUPPORTED_Q_DTYPES:
    return f"q dtype {np.dtype(q_dtype)}: the Mosaic TPU kernel takes bfloat16, float16, float32"
  return None


def reads_a_plain_copy(spec: KVCacheSpec) -> bool:
  """Whether the kernel reads ``spec``'s pages through a plain copy of the batch's pages in
  q's dtype (:mod:`kvjax.plain_copy`): formats the adapter table has no row hooks for."""
  return unsupported_reason(spec) is not None


def prefer_attention(spec, q_dtype, call) -> str | None:
  """The auto rule (registry ``prefer``): every call, but one whose plain copy
  (:func:`reads_a_plain_copy`) would pass :data:`kvjax.plain_copy.MAX_COPY_BYTES`."""
  if call is None or not reads_a_plain_copy(spec):
    return None
  nbytes = PC.copy_bytes(spec, call.num_seqs, call.max_blocks, q_dtype)
  if nbytes > PC.MAX_COPY_BYTES:
    return (f"cache_dtype={spec.cache_dtype!r} is read through a plain copy of the batch's "
            f"pages, {nbytes / 2**30:.1f} GiB here (more than "
            f"{PC.MAX_COPY_BYTES / 2**30:.0f} GiB)")
  return None


def compute_dtype(q_dtype):
  """Dtype of the MXU operands: bfloat16 for bfloat16 queries, else float32."""
  return jnp.bfloat16 if np.dtype(q_dtype) == np.dtype(jnp.bfloat16) else jnp.float32


def ragged_paged_attention(q, cache, spec: KVCacheSpec, *, query_start_loc, seq_lens,
                           block_table, scale, causal=True, sliding_window=None, soft_cap=None,
                           sinks=None, k_scale=None, v_scale=None, max_query_len=None,
                           interpret=False):
  """Ragged paged attention; arguments as :func:`kvjax.reference.unified_attention`.

  Args:
    q: ``[T, Hq, D]``. cache: the spec's physical array. query_start_loc: int32 ``[S+1]``;
      seq_lens: int32 ``[S]``; block_table: int32 ``[S, max_blocks]`` (all may be traced).
    scale: softmax scale (a float or a traced scalar). causal, sliding_window, soft_cap:
      static options. sinks: float32 ``[Hq]`` or None.
    k_scale, v_scale: fp8 per-tensor scales, None or float32 scalar / ``[H]``.
    max_query_len: static bound on any sequence's query length (None = T).
    interpret: True runs in TPU interpret mode (CPU), False compiles for a TPU; see
      :func:`pallas_kernels.mosaic_tpu.interpret.interpret_params`.
  Returns:
    ``[T, Hq, D]`` in q's dtype.
  """
  reason = supports_attention(spec, q.dtype)
  if reason is not None:
    raise ValueError(f"mosaic_tpu ragged_paged_attention: {reason}")
  if reads_a_plain_copy(spec):
    pages, plain, table = PC.plain_pages(cache, spec, block_table, k_scale, v_scale,
                                         dtype=q.dtype)
    return ragged_paged_attention(
        q, pages, plain, query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=table,
        scale=scale, causal=causal, sliding_window=sliding_window, soft_cap=soft_cap,
        sinks=sinks, max_query_len=max_query_len, interpret=interpret)
  t, hq, d = q.shape
  num_seqs, max_blocks = block_table.shape
  h = spec.num_kv_heads
  if t == 0 or num_seqs == 0:
    return jnp.zeros_like(q)
  capacity = max_blocks * spec.block_size
  # kvjax.ragged_batch rules 1 and 3 here, 2 in the tile schedule, 4 in the kernel's page DMAs.
  qsl, sl = RB.clamp_metadata(query_start_loc, seq_lens, num_tokens=t, capacity=capacity)
  plan = TL.plan_tiles(t, num_seqs, hq // h, spec.block_size, max_blocks, max_query_len)
  seq, q0, meta = TL.tile_metadata(plan, qsl, sl, capacity=capacity, causal=causal,
                                   sliding_window=sliding_window, max_query_len=max_query_len)
  codec = rows_of(spec)
  if codec.split_halves:     # head dims as [even | odd] in the kernel (rows.halves_order)
    order = halves_order(d)
    q = q[..., order]
  q_tiles = TL.gather_queries(q, plan, seq, q0, qsl)
  tile_block = pl.BlockSpec((None, h, plan.rows, d), lambda j, meta, bt: (j, 0, 0, 0))
  inputs, in_specs = [q_tiles], [tile_block]
  if sinks is not None:
    per_row = jnp.tile(jnp.asarray(sinks, jnp.float32).reshape(h, plan.group), (1, plan.tokens))
    inputs.append(jnp.broadcast_to(per_row[:, :, None], (h, plan.rows, _LANES)))
    in_specs.append(pl.BlockSpec((h, plan.rows, _LANES), lambda j, meta, bt: (0, 0, 0)))
  # Per KV head: the scores' factor (softmax scale x K scale) and the V scale, read from SMEM
  # (so the softmax scale may be traced).
  tensor_scales = spec.codec.has_tensor_scales
  k_s, v_s = spec.codec.tensor_scales(k_scale, v_scale, h)
  inputs.append(jnp.stack([jnp.asarray(scale, jnp.float32) * k_s, v_s]))
  in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
  inputs.append(cache)
  in_specs.append(pl.BlockSpec(memory_space=pl.ANY))

  page_shape = cache.shape[1:]
  kernel = functools.partial(
      _attention_kernel, plan=plan, codec=codec, layout=spec.layout,
      num_blocks=cache.shape[0], max_blocks=max_blocks, causal=causal,
      sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
      has_sinks=sinks is not None, tensor_scales=tensor_scales, cd=compute_dtype(q.dtype))
  out_tiles = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(plan.num_tiles,), in_specs=in_specs,
          out_specs=tile_block,
          scratch_shapes=[
              pltpu.VMEM((2, plan.pages_per_step) + page_shape, cache.dtype),  # KV pages x2
              pltpu.SemaphoreType.DMA((2,)),
              pltpu.VMEM((h, plan.rows, _LANES), jnp.float32),                # running max
              pltpu.VMEM((h, plan.rows, _LANES), jnp.float32),                # running sum
              pltpu.VMEM((h, plan.rows, d), jnp.float32),                     # accumulator
          ]),
      out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret_params(interpret),
      name="kvjax_mosaic_tpu_ragged_attention",
  )(meta, block_table.astype(jnp.int32).reshape(-1), *inputs)
  out = TL.scatter_outputs(out_tiles, plan, qsl, sl, t, max_query_len)
  return out[..., np.argsort(order)] if codec.split_halves else out


def _attention_kernel(meta_ref, bt_ref, q_ref, *refs, plan: TL.TilePlan, codec: Rows,
                      layout: str, num_blocks: int, max_blocks: int, causal: bool,
                      sliding_window, soft_cap, has_sinks: bool, tensor_scales: bool, cd):
  """One query tile over its sequence's visible keys, all KV heads. ``scales_ref``: float32
  ``[2, H]`` SMEM, the scores' factor (softmax scale x K scale) and the V scale per head."""
  refs = list(refs)
  sink_ref = refs.pop(0) if has_sinks else None
  scales_ref = refs.pop(0)
  cache_hbm, o_ref, buf, sems, m_ref, l_ref, acc_ref = refs
  heads, rows_n, d = acc_ref.shape
  g, n, pps = plan.group, plan.block_size, plan.pages_per_step
  kvs = plan.keys_per_step
  base = pl.program_id(0) * TL.NUM_FIELDS
  seq = meta_ref[base + TL.SEQ]
  real_rows = meta_ref[base + TL.ROWS]
  pos0 = meta_ref[base + TL.POS0]
  kv_len = meta_ref[base + TL.KV_LEN]
  kv_lo = meta_ref[base + TL.KV_LO]
  kv_hi = meta_ref[base + TL.KV_HI]
  step_lo = jax.lax.div(kv_lo, kvs)
  step_hi = jnp.where(kv_hi > kv_lo, jax.lax.div(kv_hi + kvs - 1, kvs), step_lo)

  def page_dma(step, p, slot, start: bool):
    """Start (or wait for) the copy of the step's p-th page, if it holds a visible key."""
    page = step * pps + p

    @pl.when((page * n < kv_hi) & ((page + 1) * n > kv_lo))
    def _():
      entry = bt_ref[seq * max_blocks + jnp.minimum(page, max_blocks - 1)]
      block = jnp.clip(entry, 0, num_blocks - 1)
      copy = pltpu.make_async_copy(cache_hbm.at[block], buf.at[slot, p], sems.at[slot])
      if start:
        copy.start()
      else:
        copy.wait()

  def fetch(step, slot, start: bool):
    def one(p, carry):
      page_dma(step, p, slot, start)
      return carry
    jax.lax.fori_loop(0, pps, one, 0)

  m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
  l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(step_hi > step_lo)
  def _():
    fetch(step_lo, 0, start=True)

  def attend_step(key0, slot):
    """Online-softmax update of every KV head with the keys of buffer half ``slot``."""
    row = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows_n, kvs), 0), g)
    key = key0 + jax.lax.broadcasted_iota(jnp.int32, (rows_n, kvs), 1)
    pos = pos0 + row
    # keys outside [kv_lo, kv_hi) are in pages that were not fetched (stale buffer bytes)
    mask = (row < real_rows) & (key >= kv_lo) & (key < kv_hi) & (key < kv_len)
    if causal:
      mask &= key <= pos
    if sliding_window is not None:
      mask &= pos - key < sliding_window
    key_col = key0 + jax.lax.broadcasted_iota(jnp.int32, (kvs, 1), 0)
    fetched = (key_col >= kv_lo) & (key_col < kv_hi)      # V rows of fetched, visible keys
    prec = _HIGHEST if cd == jnp.float32 else None
    for hh in range(heads):
      qh = q_ref[hh].astype(cd)
      s = sum(jax.lax.dot_general(qh[:, lo:lo + k.shape[1]], k, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32, precision=prec)
              for lo, k in _side_parts(buf, slot, hh, 0, codec, layout, cd))
      s = s * scales_ref[0, hh]
      if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
      s = jnp.where(mask, s, -jnp.inf)
      m_prev = m_ref[hh]
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
      alpha = jnp.exp(m_prev - m_safe)
      p = jnp.where(mask, jnp.exp(s - m_safe[:, :1]), 0.0)
      l_ref[hh] = alpha * l_ref[hh] + jnp.sum(p, axis=1, keepdims=True)
      for lo, v in _side_parts(buf, slot, hh, 1, codec, layout, cd):
        v = jnp.where(fetched, v, 0)
        pv = jax.lax.dot_general(p.astype(cd), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=prec)
        if tensor_scales:
          pv = pv * scales_ref[1, hh]
        cols = slice(lo, lo + v.shape[1])
        acc_ref[hh, :, cols] = acc_ref[hh, :, cols] * alpha[:, :1] + pv
      m_ref[hh] = m_next

  def body(step, carry):
    slot = jax.lax.rem(step - step_lo, 2)

    @pl.when(step + 1 < step_hi)
    def _():
      fetch(step + 1, 1 - slot, start=True)

    fetch(step, slot, start=False)
    attend_step(step * kvs, slot)
    return carry

  jax.lax.fori_loop(step_lo, step_hi, body, 0)

  row_ok = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows_n, 1), 0), g) < real_rows
  for hh in range(heads):
    m, l, acc = m_ref[hh][:, :1], l_ref[hh][:, :1], acc_ref[hh]
    if has_sinks:
      sink = sink_ref[hh][:, :1]
      m_fin = jnp.maximum(m, sink)
      corr = jnp.exp(m - m_fin)
      l = l * corr + jnp.exp(sink - m_fin)
      acc = acc * corr
    out = acc / jnp.where(l > 0, l, 1.0)
    o_ref[hh] = jnp.where(row_ok, out, 0.0).astype(o_ref.dtype)


def _side_parts(buf, slot, head: int, side: int, codec: Rows, layout: str, cd):
  """K (side 0) or V (side 1) of one KV head in buffer half ``slot``, as
  ``[(first head dim, (P * N, width) in cd)]`` (:meth:`Rows.decode_parts`)."""
  start = codec.data_start(side)

  def lanes(lo, width):
    if layout == "NHD":                   # buf: (2, P, N, H, C)
      return buf[slot, :, :, head, pl.ds(lo, width)]
    return buf[slot, :, head, :, pl.ds(lo, width)]   # buf: (2, P, H, N, C)

  w = codec.data_width
  scale_bytes = lanes(start + w, 4) if codec.row_scaled else None
  return [(lo, vals.reshape(vals.shape[0] * vals.shape[1], vals.shape[2]))
          for lo, vals in codec.decode_parts(lanes(start, w), scale_bytes, cd)]  # (P, N, w')
