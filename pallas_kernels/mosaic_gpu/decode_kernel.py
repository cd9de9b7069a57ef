"""The Mosaic GPU (Hopper) paged decode kernel body: one query token per sequence.

Scores are computed transposed, ``S^T = K q^T``: the ``T = 64`` keys of a step are wgmma's
M rows and the query heads of one KV head its ``N = 16`` columns (at GQA 4, 4 of 16 columns
are real, against 4 of wgmma's 64 rows for ``q K^T``), so the online softmax costs 8 values a
thread per step. Values follow the same orientation, ``O^T += V^T P^T``: ``P^T`` (through
shared memory) is the B operand and V the transposed A operand. Operands of one wgmma share
a swizzle, and P^T's 16-column rows allow 32 bytes, while TMA copies rows no wider than the
swizzle; so K/V land with the format's swizzle (plain caches: the widest their rows allow,
128 bytes, one copy per 64 bf16 columns, as with q for ``S^T``), and V is copied into a
32-byte-swizzled buffer on its way to ``V^T P^T`` (in the compute dtype: the format hook
converts there).

One CUDA block of one warpgroup per (KV head, query row, split), up to
:func:`.tuning.decode_blocks_per_sm` of them an SM (a warpgroup that only issued copies would
hold as many registers as the one computing, and halve the blocks an SM's registers take).
The block walks its split's key steps of T keys, each in one of ``stages`` shared-memory
slots for K and for V:

* **copies**: before the loop, each slot's first step; the block ids of a step's pages are
  read from the block table a round ahead, and both sides of a slot are refilled with the
  step ``stages`` later once every thread has read its V (one warpgroup barrier a step,
  the one that makes the step's V buffer visible to wgmma; TMA copies of ``piece`` tokens,
  :mod:`.decode_copies`; format hooks say where they land:
  :mod:`pallas_kernels.mosaic_gpu.formats`). Formats with a scale per row
  (:mod:`.row_formats`) copy from a view of the cache with rows of one or two tokens; with
  two, step j of a round of ``2 T`` tokens holds the tokens of parity j, so that every row of
  a slot lands at the same offset (``landing_offsets``). nvfp4 (:mod:`.group_formats`) copies
  each piece's data rows and scale rows, two copies on the slot's barrier;
* **compute**: rounds of ``u = geo.round_steps`` steps, one softmax update each: per step
  the format hook builds the K operand and ``S^T``'s wgmma is issued (the next step's K is
  built while one runs), then scales (softmax scale x K scale x log2 e, one float per head;
  format hooks add the per-key scales and zero points), soft-caps, masks keys outside
  ``[seq_len - window, seq_len)``; the round updates the running max per column (one
  cross-warp reduction) and a per-thread partial sum, stores ``P^T`` to shared memory,
  builds each step's V operand (format hook; rows of masked keys set to 0: stale cache bytes
  may be NaN) and accumulates ``V^T P^T`` (``u T`` keys) into a float32 ``(D, 16)``
  accumulator.

The block writes its unnormalized partials (``acc^T``, the max in the log2 domain, the sum)
as one split of the output; :func:`pallas_kernels.common.merge_splits` combines them in XLA.
With one split the block can finish the job instead (``DecodeStatics.finish``): it starts
the running max and sum at the sinks (a sink is one more key whose value row is 0), normalizes
``acc^T``, turns it into query rows with one more wgmma, ``O = E O^T^T`` where ``E`` (64 x
16) holds a 1 at ``(r, c0 + r)`` (the exact transpose of the bf16 / f16-rounded output, its
rows ``r < G`` the head's queries), applies the V scale and copies the G rows into the
output ``[R, Hq, D]``: one kernel launch is the whole decode.
The query rows: head h's G queries are rows ``[h G, h G + G)`` of ``q[s]``; the kernel
copies the 16 rows from ``r0 = h G - (h G) % 8`` (a TMA copy into a tiled buffer must start
on a multiple of 8 rows), so head h's queries are columns ``(h G) % 8 + [0, G)`` of S^T; the
other columns hold neighbouring heads' queries (finite, discarded) or zeros past ``Hq``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu.compat import interpret_params
from pallas_kernels.mosaic_gpu.decode_copies import Copies
from pallas_kernels.mosaic_gpu.decode_geometry import ALIGN_ROWS, DecodeStatics
from pallas_kernels.mosaic_gpu.decode_parts import M_INIT, column_values, row_sequence, staged



@dataclasses.dataclass(frozen=True)
class _Refs:
  """The kernel's GMEM refs: inputs (``vfac``, ``sinks``: finish mode only; ``sinks`` only
  with sinks) and outputs (``acc``, ``ml``: partials; ``out``: finish mode)."""
  qsl: object
  lens: object
  bt: object
  fac: object
  q: object
  cache: object
  layer: object = None
  vfac: object = None
  sinks: object = None
  qsums: object = None
  acc: object = None
  ml: object = None
  out: object = None


def _kernel(refs: _Refs, q_smem, q_bar, k_bars, v_bars, *, st: DecodeStatics,
            out_dtype=None):
  """The block's work; the key loop's buffers (:func:`_loop_buffers`) and the epilogue's
  (:func:`_epilogue_buffers`) are scoped one after the other and share shared memory."""
  geo, ops = st.geo, st.ops
  t_keys, ncol, d = geo.block_kv, geo.cols, geo.head_size
  wgmma_layout = plgpu.Layout.WGMMA
  cast = plgpu.layout_cast
  h = lax.axis_index("head")
  r = lax.axis_index("row")
  split = lax.axis_index("split")
  u = geo.round_steps

  # Row r's sequence, its keys [lo_tok, seq_len) in rounds of st.span tokens; this split's
  # rounds [start, start + n), n * u steps. A row of no sequence reads no key (output 0).
  seq, real = row_sequence(refs.qsl, r, st.num_seqs)
  seq_len = jnp.where(real, jnp.clip(refs.lens[seq], 0, st.capacity), 0)
  lo_tok = jnp.maximum(seq_len - st.window, 0) if st.window else jnp.int32(0)
  lo_round = lax.div(lo_tok, st.span)
  hi_round = lax.div(seq_len + st.span - 1, st.span)
  per = lax.div(jnp.maximum(hi_round - lo_round, 0) + st.num_splits - 1, st.num_splits)
  start = lo_round + split * per
  n = jnp.clip(hi_round - start, 0, per)
  steps = n * u
  hg = h * geo.group
  row0 = hg - lax.rem(hg, ALIGN_ROWS)           # head h's queries: columns hg - row0 + [0, G)
  plgpu.copy_gmem_to_smem(refs.q.at[r, pl.ds(row0, ncol)], q_smem, q_bar)
  rows = cast(lax.broadcasted_iota(jnp.int32, (t_keys, ncol), 0), wgmma_layout)

  def key_loop(head_parity: int, k_land, v_land, v_smem, p_smem, k_staged=None):
    """The split's rounds: ``(acc, m, l_part, v_state)`` after the last."""
    copies = Copies(refs, st, seq, start, steps, (k_land, v_land), (k_bars, v_bars))
    for i in range(geo.stages):     # the first slots' copies; each later one refills a slot
      ids = copies.block_ids(i)     # as soon as the step before in it has been read
      copies.refill(i, 0, ids)
      copies.refill(i, 1, ids)
    plgpu.barrier_wait(q_bar)
    fac = refs.fac[h]
    v_rows = cast(lax.broadcasted_iota(jnp.int32, (t_keys, d), 0), wgmma_layout)
    q_sums = tuple(column_values(refs.qsums.at[r, j], row0, rows)
                   for j in range(ops.num_q_sums))

    def one_round(k, carry):
      """Round k: its ``u`` steps' keys in one softmax update (step j's slot row t holds key
      ``tok0 + key_offset(j) + tokens_per_row * t``)."""
      acc, m, l_part, v_state = carry
      tok0 = (start + k) * st.span
      in_round = range(u)
      slots = [lax.rem(k * u + j, geo.stages) for j in in_round]
      later = [k * u + j + geo.stages for j in in_round]      # the steps that refill them
      later_ids = [copies.block_ids(i) for i in later]      # loaded while this round runs
      offsets = [st.landing_offsets(head_parity, st.step_parity(j)) for j in in_round]
      k_rows = [_landed(ops.step_slot(k_land, slots[j], st.interpret), st, offsets[j][0])
                for j in in_round]
      v_rows_refs = [_landed(ops.step_slot(v_land, slots[j], st.interpret), st, offsets[j][1])
                     for j in in_round]

      def qk(*acc_refs):     # each step's products issued as its K lands, then all awaited
        for j, acc_ref in enumerate(acc_refs):
          plgpu.barrier_wait(k_bars.at[slots[j]])
          products = ops.score_operands(k_rows[j], q_smem)
          if k_staged is not None:   # interpret mode takes no register operand: stage K
            products = staged(products, k_staged.at[j])
          for a_op, b_op in products:
            plgpu.wgmma(acc_ref, a_op, b_op)
        return tuple(acc_ref[...] for acc_ref in acc_refs)
      scores = pl.run_scoped(qk, *[plgpu.ACC((t_keys, ncol), jnp.float32) for _ in in_round])
      scores = [ops.scale_scores(sc, k_rows[j], fac, q_sums)      # the log2 domain
                for j, sc in enumerate(scores)]
      visible = [(tok >= lo_tok) & (tok < seq_len) for tok in
                 (tok0 + st.key_offset(j) + st.tokens_per_row * rows for j in in_round)]
      if st.soft_cap is not None:   # c * tanh(x / c) of x = s / log2(e), in the log2 domain
        cap = st.soft_cap * math.log2(math.e)
        scores = [cap * jnp.tanh(sc * (1.0 / cap)) for sc in scores]
      scores = [jnp.where(vis, sc, -jnp.inf) for vis, sc in zip(visible, scores)]
      m_new = jnp.maximum(m, functools.reduce(jnp.maximum, scores).max(axis=0))
      alpha = jnp.exp2(m - m_new)
      p = [jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [1])) for sc in scores]
      l_part = l_part * lax.broadcast_in_dim(alpha, l_part.shape, [1]) + functools.reduce(
          jnp.add, p)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
      for j in in_round:
        if ops.row_scaled:         # the weights take the V scales: wait for V first
          plgpu.barrier_wait(v_bars.at[slots[j]])
        weights, v_state = ops.value_weights(p[j], v_rows_refs[j], visible[j],
                                             alpha if j == 0 else None, v_state)
        p_smem.at[pl.ds(j * t_keys, t_keys)][...] = weights.astype(ops.compute)
      plgpu.commit_smem()          # generic-proxy stores visible to wgmma (async proxy)

      for j in in_round:
        if not ops.row_scaled:
          plgpu.barrier_wait(v_bars.at[slots[j]])
        first = tok0 + st.key_offset(j)     # the step's keys: first + r * [0, T)
        edge = (first < lo_tok) | (first + st.tokens_per_row * (t_keys - 1) >= seq_len)
        v_dst = v_smem.at[pl.ds(j * t_keys, t_keys)]
        keep = (st.tokens_per_row * v_rows + st.key_offset(j), lo_tok - tok0, seq_len - tok0)
        # prepare_v ends in commit_smem: every thread has read both sides of the slot.
        pl.when(edge)(functools.partial(ops.prepare_v, v_rows_refs[j], v_dst, keep,
                                        plgpu.commit_smem))
        pl.when(jnp.logical_not(edge))(functools.partial(ops.prepare_v, v_rows_refs[j], v_dst,
                                                         None, plgpu.commit_smem))
        copies.refill(later[j], 0, later_ids[j])
        copies.refill(later[j], 1, later_ids[j])

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, v_smem.transpose((1, 0)), p_smem)
        return acc_ref[...]
      acc = acc + pl.run_scoped(pv, plgpu.ACC((d, ncol), jnp.float32))
      return acc, m_new, l_part, v_state

    acc0 = cast(jnp.zeros((d, ncol), jnp.float32), wgmma_layout)
    if st.sinks:     # a sink is a key whose value row is 0: max starts at it, sum at 1
      m0 = column_values(refs.sinks, row0, rows)
      l0 = cast(jnp.where(rows == 0, 1.0, 0.0).astype(jnp.float32), wgmma_layout)
    else:
      m0 = cast(jnp.full((ncol,), M_INIT, jnp.float32), wgmma_layout.reduce(0))
      l0 = cast(jnp.zeros((t_keys, ncol), jnp.float32), wgmma_layout)
    carry = (acc0, m0, l0, ops.value_state((t_keys, ncol)))
    return lax.fori_loop(0, n, one_round, carry)

  def block(head_parity: int):
    acc, m, l_part, v_state = pl.run_scoped(functools.partial(key_loop, head_parity),
                                            *_loop_buffers(st))
    acc = ops.finish_values(acc, v_state)
    if st.finish:
      pl.run_scoped(functools.partial(_write_rows, refs, acc, l_part.sum(axis=0), rows,
                                      hg - row0, st=st), *_epilogue_buffers(st, out_dtype))
      return

    def write_partials(o_smem, ml_smem):
      o_smem[...] = acc
      ml_smem[0, :] = m
      ml_smem[1, :] = l_part.sum(axis=0)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, refs.acc.at[r, h, split])
      plgpu.copy_smem_to_gmem(ml_smem, refs.ml.at[r, h, split])
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(write_partials, *_epilogue_buffers(st, out_dtype))

  if len(st.head_parities) == 1:
    block(st.head_parities[0])
  else:                                  # the landing offsets are static in each
    for head_parity in st.head_parities:
      pl.when(lax.rem(h, 2) == head_parity)(functools.partial(block, head_parity))


def _landed(slot_ref, st: DecodeStatics, offset: int):
  """What a format's hooks read of a landing slot: the slot itself, or for row-scaled
  formats its rows from the data on (``offset``: :meth:`DecodeStatics.landing_offsets`),
  ``(T, data + 4)``: the data, then the scale."""
  if not st.ops.row_scaled:
    return slot_ref
  return slot_ref.at[:, pl.ds(offset, st.ops.data_cols(st.geo.head_size) + 4)]


def _write_rows(refs: _Refs, acc, l, rows, c0, ot_smem, p_smem, out_smem, *,
                st: DecodeStatics):
  """Finish mode: the normalized output of head h's G queries, as rows of ``refs.out``.

  acc: float32 ``(D, 16)`` (``O^T`` unnormalized, WGMMA layout); l: ``(16,)`` sums; rows:
  int32 ``(64, 16)`` row iota (WGMMA layout); c0: the column of the head's first query.
  ``ot_smem`` ``(D, 16)`` takes ``O^T`` in the compute dtype, ``p_smem`` ``(64, 16)`` the
  selection ``E``, ``out_smem`` ``(64, D)`` the rows in the output dtype.
  """
  wgmma_layout = plgpu.Layout.WGMMA
  h, r = lax.axis_index("head"), lax.axis_index("row")
  t_keys, d, group = st.geo.block_kv, st.geo.head_size, st.geo.group
  inv = jnp.where(l > 0, 1.0 / l, 0.0)            # no visible key: the output is 0
  ot_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [1])).astype(st.ops.compute)
  cols = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, rows.shape, 1), wgmma_layout)
  p_smem[...] = jnp.where(cols == rows + c0, 1.0, 0.0).astype(st.ops.compute)
  plgpu.commit_smem()

  def transpose(acc_ref):
    plgpu.wgmma(acc_ref, p_smem, ot_smem.transpose((1, 0)))
    return acc_ref[...]
  o = pl.run_scoped(transpose, plgpu.ACC((t_keys, d), jnp.float32))
  out_smem[...] = (o * refs.vfac[h]).astype(out_smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, group)],
                          refs.out.at[r, pl.ds(h * group, group)])
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the grid's end makes the rows visible


def decode_call(query_start_loc, seq_lens, block_table_flat, factors, q, cache, *,
                st: DecodeStatics, v_factors=None, sinks=None, out_dtype=None, layer=None,
                q_sums=None):
  """Launch the kernel: one CUDA block per (KV head, query row, split).

  query_start_loc: int32 ``[S+1]`` (each sequence has at most one query row: a decode
  batch); seq_lens: int32 ``[S]`` keys of each sequence (clipped to ``[0, capacity]``);
  block_table_flat: int32 ``[S * max_blocks]`` (row s: that sequence's block ids); factors:
  float32 ``[H]``, softmax scale x K scale x log2(e) per KV head; q: ``[R, Hq', D]`` query
  rows in the compute dtype and the format's order (Hq' >= Hq: :func:`.decode.padded_heads`);
  cache: the physical cache, or the row-scaled formats' view (:func:`.decode.cache_view`);
  layered with ``st.layer_axis``: then layer, int32 ``[1]``, the layer read. q_sums: float32
  ``[R, k, Hq']``, the format's per-query sums (``ops.q_sums``) where it takes them. Rows of
  no sequence read no key.

  Partials (``st.finish`` False): returns the unnormalized partials, one per split: acc
  float32 ``[R, H, splits, D, 16]`` (transposed: columns are query columns), and float32
  ``[R, H, splits, 2, 16]`` holding the running max (log2 domain) and the sum.
  Finish mode: also v_factors float32 ``[H]`` (V scale per KV head), sinks float32 ``[Hq']``
  (log2 domain, with ``st.sinks``), out_dtype; returns ``[R, Hq, D]`` of out_dtype, Hq =
  G * H (rows of no sequence: 0).
  """
  geo, ops = st.geo, st.ops
  num_rows = q.shape[0]
  h = st.num_kv_heads
  parts = st.num_splits
  d, ncol = geo.head_size, geo.cols
  kv_bars = plgpu.Barrier(num_arrivals=st.copies_per_step * (2 if ops.scale_copies else 1),
                          num_barriers=geo.stages)
  f32 = jnp.float32
  layered = st.layer_axis is not None
  sums = st.ops.num_q_sums > 0
  tail_names = ("q", "cache") + (("qsums",) if sums else ()) + (("layer",) if layered else ())
  tail = (q, cache) + ((q_sums,) if sums else ()) + ((layer,) if layered else ())
  if st.finish:
    names = ("qsl", "lens", "bt", "fac", "vfac") + (("sinks",) if st.sinks else ()) + (
        tail_names + ("out",))
    args = (query_start_loc, seq_lens, block_table_flat, factors, v_factors) + (
        (sinks,) if st.sinks else ()) + tail
    out_type = jax.ShapeDtypeStruct((num_rows, h * geo.group, d), out_dtype)
  else:
    names = ("qsl", "lens", "bt", "fac") + tail_names + ("acc", "ml")
    args = (query_start_loc, seq_lens, block_table_flat, factors) + tail
    out_type = (jax.ShapeDtypeStruct((num_rows, h, parts, d, ncol), f32),
                jax.ShapeDtypeStruct((num_rows, h, parts, 2, ncol), f32))

  def kvjax_mgpu_decode(*gmem_refs):
    refs = _Refs(**dict(zip(names, gmem_refs, strict=True)))
    pl.run_scoped(
        lambda *scratch: _kernel(refs, *scratch, st=st, out_dtype=out_dtype),
        _tiled((ncol, d), ops.compute, ops.q_swizzle(d)), plgpu.Barrier(num_arrivals=1),
        kv_bars, kv_bars)

  return plgpu.kernel(
      kvjax_mgpu_decode,
      out_type=out_type,
      grid=(h, num_rows, st.num_splits),
      grid_names=("head", "row", "split"),
      interpret=interpret_params() if st.interpret else None,
      compiler_params=plgpu.CompilerParams(   # Lane semantics on every version: compat.py
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
  )(*args)


def _tiled(shape, dtype, swizzle=None):
  """A buffer wgmma reads: (8, swizzle / itemsize)-element tiles; the widest swizzle whose
  rows tile the minor dim by default (TMA copies rows no wider than the swizzle)."""
  width = shape[-1] * np.dtype(dtype).itemsize
  swizzle = swizzle or next(w for w in (128, 64, 32) if width % w == 0)
  cols = swizzle // np.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((ALIGN_ROWS, cols)),
                                              plgpu.SwizzleTransform(swizzle)))


def _pv_swizzle(st: DecodeStatics) -> int:
  """The swizzle of ``V^T P^T``'s operands: that of P^T's rows (16 query columns)."""
  return st.geo.cols * np.dtype(st.ops.compute).itemsize


def _loop_buffers(st: DecodeStatics):
  """The key loop's buffers: the K and V landing slots (the format's), V and P^T in the
  compute dtype (``(u T, D)``, ``(u T, 16)``, read by ``V^T P^T`` with P^T's swizzle), and
  in interpret mode, for formats whose K operand is registers, a ``(u, T, D)`` K buffer."""
  geo, ops = st.geo, st.ops
  t_keys, d, u = geo.block_kv, geo.head_size, geo.round_steps
  bufs = (ops.landing(geo.stages, t_keys, d, _tiled, 0), ops.landing(geo.stages, t_keys, d,
                                                                     _tiled, 1),
          _tiled((u * t_keys, d), ops.compute, _pv_swizzle(st)),
          _tiled((u * t_keys, geo.cols), ops.compute, _pv_swizzle(st)))
  if ops.k_in_registers and st.interpret:
    bufs += (_tiled((u, t_keys, d), ops.compute),)
  return bufs


def _epilogue_buffers(st: DecodeStatics, out_dtype):
  """The buffers after the key loop: the partials' ``acc^T`` (float32 ``(D, 16)``) and max /
  sum ``(2, 16)``; in finish mode ``O^T`` in the compute dtype (``(D, 16)``, read
  transposed by wgmma), the selection ``E`` (``(64, 16)``) and the output rows ``(64, D)``
  (copied out by TMA)."""
  d, ncol, t_keys = st.geo.head_size, st.geo.cols, st.geo.block_kv
  if st.finish:
    return (_tiled((d, ncol), st.ops.compute, _pv_swizzle(st)),
            _tiled((t_keys, ncol), st.ops.compute, _pv_swizzle(st)),
            plgpu.SMEM((t_keys, d), out_dtype))
  return plgpu.SMEM((d, ncol), jnp.float32), plgpu.SMEM((2, ncol), jnp.float32)
