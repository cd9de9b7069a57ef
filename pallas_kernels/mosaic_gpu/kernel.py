"""The Mosaic GPU (Hopper) kernel body of the ragged paged attention.

Work items are (KV head, query tile) pairs (:mod:`pallas_kernels.mosaic_gpu.tiles`), each
sequence's tiles from the one with the most keys down (:mod:`.work_items`). With
``num_programs`` blocks (one per SM by default, :func:`.tuning.num_programs`) block
``p`` walks items ``p, p + P, p + 2P, ...``:
its K/V slots and barriers carry over from one item to the next (the block's n-th key step,
counted over its items, uses slot ``n % stages``), so the producer copies the next item's
first K/V steps while the consumers finish the current one, and no block pays a launch and a
cold pipeline per item. ``num_programs=0`` launches one block per item (the former schedule;
the same arithmetic per item, bitwise the same output). A block has ``num_wgs + 1``
warpgroups:

* the **producer** warpgroup (the last one, few registers) walks its items' key steps and,
  per step, reads the block ids from the block table and issues one TMA copy per
  ``piece`` tokens for K and for V of the item's KV head straight out of the packed cache
  (NHD: an ``(piece, D)`` box with rows ``H * 2D`` apart; HND: rows ``2D`` apart), into
  ``stages`` shared-memory slots; it reuses a slot once every consumer has released it,
  and at the end waits for the last releases too (so every barrier phase is observed, which
  interpret mode checks);
* each **consumer** warpgroup owns 64 rows of the tile: per item it loads its q slabs once
  (TMA into a staging buffer that is not tiled, then registers into the tiled buffer wgmma
  reads: a tile starts at any token, see tiles.py "Alignment"; ``KernelStatics.staging``,
  ``tiles.STAGINGS``: compiled, 64-column chunks with the 128-byte swizzle, so that loads and
  stores between staging and registers have no bank conflicts, in a buffer of q's own where
  shared memory allows), then per step computes
  ``S = q K^T`` with wgmma (float32 accumulators in registers), releases K, applies scale,
  soft cap and the causal / window / sequence-end mask (only on steps that cross an edge),
  updates the online softmax in the exp2 domain, waits for V, and accumulates ``P V`` with wgmma
  (``tiles.PV_VARIANTS``: P in registers or through shared memory, accumulated in place or
  into a fresh accumulator), waiting for the next step's K while that wgmma runs.

With two consumer warpgroups their tensor-core work alternates (FlashAttention-3's
"ping-pong"): a two-arrival *schedule* barrier that each passes once after issuing its
``q K^T`` and once after its softmax orders the wgmmas as wg0 qK, wg1 qK, wg0 PV, wg0 qK
(next step), wg1 PV, ..., so one warpgroup's softmax runs while the other's products occupy
the tensor cores. Per item, warpgroup 1 passes the barrier once before its first step and
warpgroup 0 once after its last, so both pass it ``2 * steps + 1`` times (both walk the same
items and key steps: their rows are other heads of the same tokens).

Keys past the sequence end in the last step are whatever the cache holds there (stale
bytes, NaN): their scores are selected away, and the V rows of that step past the end are
zeroed in shared memory before ``P V`` so that ``0 * NaN`` never happens. The output goes
through the output staging buffer (the one q is staged in when q has none of its own) and TMA
stores of power-of-two row counts, so only the tile's real tokens are written (tiles of other
sequences own the rest); the next item's q or output waits until the stores have read it.

A quantized format read as stored (``st.ops``, :mod:`.ragged_landing`): the producer copies
each step's bytes into a landing slot per side, converts them into the plain K/V slots and
arrives on their barriers itself; the consumers run as on a plain cache.

A rotated format (``st.rotation``: int4 per token-head, read through a plain copy in its
stored frame) takes q and gives its output in the model's frame: the block copies the
rotation's ``(D, D)`` matrix into shared memory once, each consumer multiplies its staged q
rows by it (one wgmma, rounded to q's dtype in place) and its normalized output rows, rounded
to q's dtype and passed through its q buffer, by the transpose
(:func:`.ragged_parts.rotate_rows`, :func:`.ragged_parts.unrotate_rows`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu import tiles as TL
from pallas_kernels.mosaic_gpu.compat import interpret_params, load_whole
from pallas_kernels.mosaic_gpu.kernel_statics import (SWIZZLE_ELEMS as _SWIZZLE_ELEMS,
                                                      KernelStatics)
from pallas_kernels.mosaic_gpu.ragged_landing import landing_scratch, produce_item
from pallas_kernels.mosaic_gpu.ragged_parts import (accumulate_pv, rotate_rows, store_output,
                                                    unrotate_rows)
from pallas_kernels.mosaic_gpu.work_items import for_each_item as _for_each_item
from pallas_kernels.mosaic_gpu.work_items import work_item as _work_item

_LOG2E = math.log2(math.e)
_M_INIT = -1e30   # running max before any key: finite, so exp2(m_old - m_new) is never NaN
_SWIZZLE = 128    # bytes: the widest wgmma swizzle; 64 bf16 columns per tile row


def _smem_tiled(shape, dtype, swizzle=None):
  """A shared-memory buffer in the layout wgmma reads: (8, swizzle / itemsize)-element tiles,
  by default the 128-byte swizzle (64 columns of 16 bits)."""
  swizzle = swizzle or _SWIZZLE
  cols = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)),
                                              plgpu.SwizzleTransform(swizzle)))


def _kv_box(cache_ref, st: KernelStatics, blk, h, off, n, side):
  """``(n, D)`` GMEM box of K (side 0) or V (side 1) of head h, tokens off..off+n of page blk."""
  cols = pl.ds(side * st.head_size, st.head_size)
  if st.layout == "NHD":
    return cache_ref.at[blk, pl.ds(off, n), h, cols]
  return cache_ref.at[blk, h, pl.ds(off, n), cols]


def _kernel(meta_ref, bt_ref, sinks_ref, scale_ref, rt_ref, ts_ref, q_ref, cache_ref, o_ref,
            scratch, *, st: KernelStatics):
  ((q_smem, o_smem, k_smem, v_smem, p_smem, qs_smem), q_bars, (k_bars, v_bars),
   (k_free, v_free), sched_bar, (rt_smem, rt_bar), (landing, land_bars)) = scratch
  geo = st.geo
  g_count, bq, bk, d = geo.group, geo.bq, geo.block_kv, st.head_size
  cast = plgpu.layout_cast
  wgmma_layout = plgpu.Layout.WGMMA
  wg = lax.axis_index("wg")
  # K/V slots and their barriers are used round-robin over the block's key steps across all
  # its work items: the block's step n (counted over its items) uses slot n % stages.
  slot_of = lambda n: lax.rem(n, geo.stages)

  @pl.when(wg < geo.num_wgs)
  def _consumer():
    plgpu.set_max_registers(st.register_split[0], action="increase")
    shape = (TL.WG_ROWS, bk)
    row = cast(lax.broadcasted_iota(jnp.int32, shape, 0), wgmma_layout) + wg * TL.WG_ROWS
    col = cast(lax.broadcasted_iota(jnp.int32, shape, 1), wgmma_layout)
    row_layout = wgmma_layout.reduce(1)
    ping_pong = sched_bar is not None

    def pass_schedule():   # both consumer warpgroups meet here (a two-arrival barrier)
      plgpu.barrier_arrive(sched_bar)
      plgpu.barrier_wait(sched_bar)

    # Scores enter the exp2 domain scaled by scale * log2(e): without a soft cap and with a
    # static positive scale the factor folds into the exponent's fused multiply-add
    # (max(s) * f == max(s * f) for f > 0); otherwise s is scaled first (before the tanh).
    fold = st.soft_cap is None and st.scale is not None and st.scale > 0
    to_log2 = (lambda x: x * (st.scale * _LOG2E)) if fold else (lambda x: x)
    log2_factor = (st.scale if st.scale is not None else scale_ref[0]) * _LOG2E

    chunks = st.stage_chunks
    q_stage = o_smem if qs_smem is None else qs_smem      # where q lands before registers
    if st.rotation:      # the rotation's matrix, once a block (both warpgroups read it)
      @pl.when(wg == 0)
      def _copy_matrix():
        plgpu.copy_gmem_to_smem(rt_ref, rt_smem, rt_bar)
      plgpu.barrier_wait(rt_bar)

    def copy_q(w_, t):
      """TMA copies of warpgroup w_'s q slabs of item t into its staging buffer (not tiled:
      a box may start at any token; swizzled: one copy per 64-column chunk)."""
      for sl in geo.slabs(w_):
        src = q_ref.at[pl.ds(t.tok0 + sl.tok, sl.n), t.h * g_count + sl.g]
        if not chunks:
          plgpu.copy_gmem_to_smem(src, q_stage.at[w_, pl.ds(sl.row, sl.n)], q_bars[w_])
        for c in range(chunks):
          plgpu.copy_gmem_to_smem(src.at[:, pl.ds(c * _SWIZZLE_ELEMS, _SWIZZLE_ELEMS)],
                                  q_stage.at[w_, c, pl.ds(sl.row, sl.n)], q_bars[w_])

    def stage_to_q(w_):
      """Warpgroup w_'s staged q -> registers -> the tiled, swizzled buffer wgmma reads."""
      if not chunks:        # rows 2D bytes apart: not a bank-conflict-free load
        q_smem.at[w_][...] = load_whole(q_stage.at[w_], layout=wgmma_layout, optimized=False)
      for c in range(chunks):
        q_smem.at[w_, :, pl.ds(c * _SWIZZLE_ELEMS, _SWIZZLE_ELEMS)][...] = load_whole(
            q_stage.at[w_, c], layout=wgmma_layout)

    def item(w, base):
      """Work item w, whose first key step is the block's step ``base``; returns the block's
      step count after it."""
      t = _work_item(meta_ref, w, st)
      h = t.h
      for w_ in range(geo.num_wgs):                # q slabs of this warpgroup, one barrier
        @pl.when((wg == w_) & (t.nq > 0))            # surplus tiles: no rows, no keys
        def _load_q():
          # Through untiled memory: a TMA copy straight into the tiled buffer would split the
          # token start into (start // 8, start % 8) box coordinates, so a start that is not
          # a multiple of 8 would zero-fill rows of every 8-row group.
          copy_q(w_, t)
          plgpu.barrier_wait(q_bars[w_])
          stage_to_q(w_)
          plgpu.commit_smem()    # generic-proxy stores visible to wgmma (async proxy)
          if st.rotation:
            rotate_rows(q_smem.at[w_], rt_smem, st.dtype)
      q_wg = q_smem.at[wg]
      q_pos = t.pos0 + lax.rem(row, bq)            # absolute position of each row's token

      if st.has_sinks:  # a sink is one more logit in the softmax: start from m = sink, l = 1
        g_of_row = lax.div(row, bq)
        sink = jnp.full(shape, _M_INIT, jnp.float32)
        for g in range(g_count):
          sink = jnp.where(g_of_row == g, sinks_ref[h * g_count + g] * _LOG2E, sink)
        m0 = sink.max(axis=1)
        l0 = cast(jnp.full((TL.WG_ROWS,), 1.0, jnp.float32), row_layout)
      else:
        m0 = cast(jnp.full((TL.WG_ROWS,), _M_INIT, jnp.float32), row_layout)
        l0 = cast(jnp.zeros((TL.WG_ROWS,), jnp.float32), row_layout)
      acc0 = cast(jnp.zeros((TL.WG_ROWS, d), jnp.float32), wgmma_layout)

      def step(j, carry, masked: bool):
        acc, m, l = carry
        slot = slot_of(base + j - t.j_lo)      # its K was waited for by the step before

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_wg, k_smem.at[slot].transpose((1, 0)))
          if ping_pong:
            pass_schedule()      # the other warpgroup's wgmmas are issued next
          return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        if not fold:
          s = s * log2_factor
        if st.soft_cap is not None:   # c * tanh(x / c) of x = s / log2(e), in the log2 domain
          cap = st.soft_cap * _LOG2E
          s = cap * jnp.tanh(s * (1.0 / cap))
        if masked:
          key = j * bk + col
          vis = key < t.kv_len
          if st.causal:
            vis = vis & (key <= q_pos)
          if st.window:
            vis = vis & (q_pos - key < st.window)
          s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, to_log2(s.max(axis=1)))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(to_log2(s) - lax.broadcast_in_dim(m_new, shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l = l * alpha
        p16 = p.astype(st.dtype)

        def end_softmax():       # the tensor cores are this warpgroup's again after this
          if ping_pong:
            plgpu.barrier_arrive(sched_bar)
          plgpu.barrier_wait(v_bars.at[slot])
          if ping_pong:
            plgpu.barrier_wait(sched_bar)
        # The order of the row sum and the barriers, and the optimization barrier that pins
        # it, are FlashAttention-3's (JAX's attention_mgpu measured them to matter).
        if d <= 128:
          l = l + p.sum(axis=1)
          acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
          end_softmax()
        else:
          end_softmax()
          l = l + p.sum(axis=1)
        if masked:
          @pl.when((j + 1) * bk > t.kv_len)
          def _zero_v_past_end():   # 64 rows at a time: fewer live registers
            v_row = cast(lax.broadcasted_iota(jnp.int32, (TL.WG_ROWS, d), 0), wgmma_layout)
            for r0 in range(0, bk, TL.WG_ROWS):
              v_ref = v_smem.at[slot, pl.ds(r0, TL.WG_ROWS)]
              keep = v_row < t.kv_len - j * bk - r0
              v_ref[...] = jnp.where(keep, v_ref[...], 0).astype(st.dtype)
            plgpu.commit_smem()

        def wait_next_k():       # while the P V wgmma runs
          @pl.when(j + 1 < t.j_hi)
          def _():
            plgpu.barrier_wait(k_bars.at[slot_of(base + j + 1 - t.j_lo)])

        acc = accumulate_pv(acc, p16, v_smem.at[slot],
                            None if p_smem is None else p_smem.at[wg], st.pv, wait_next_k)
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      @pl.when(t.num_steps > 0)
      def _first_k():
        plgpu.barrier_wait(k_bars.at[slot_of(base)])
      if ping_pong:
        pl.when(wg == 1)(pass_schedule)   # warpgroup 0 issues first
      carry = (acc0, m0, l0)
      carry = lax.fori_loop(t.j_lo, t.b, lambda j, cr: step(j, cr, True), carry)
      carry = lax.fori_loop(t.b, t.c_end, lambda j, cr: step(j, cr, False), carry)
      acc, _, l = lax.fori_loop(t.c_end, t.j_hi, lambda j, cr: step(j, cr, True), carry)
      if ping_pong:
        pl.when(wg == 0)(pass_schedule)   # the pass warpgroup 1 made before its first step

      l_safe = jnp.where(l > 0, l, 1.0)
      out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
      if st.rotation:
        out = unrotate_rows(out, q_wg, rt_smem, st.dtype, st.out_factor)
      store_output(out, st.dtype, o_smem, o_ref, wg, geo, t.tok0, t.nq, h * g_count, chunks)
      # the next item writes the staging buffer (its q, or with q_own its output), so the
      # stores must have read it by then
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      return base + t.num_steps

    _for_each_item(st, item, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == geo.num_wgs)
  def _producer():
    plgpu.set_max_registers(st.register_split[1], action="decrease")
    piece = geo.piece

    def item(w, base):
      t = _work_item(meta_ref, w, st)

      def block_ids(j):
        """The block of each piece of step ``j``, all loaded before any copy is issued (the
        loads overlap; K and V of the step share them)."""
        ids = []
        for p in range(geo.pieces_per_step):
          page = jnp.minimum(lax.div(j * bk + p * piece, geo.block_size), st.max_blocks - 1)
          ids.append(jnp.clip(bt_ref[t.bt_row + page], 0, st.num_blocks - 1))
        return ids

      def issue(j, dst, bar, side, ids):
        """TMA copies of step j's K (side 0) or V (1) into the ``(block_kv, D)`` slot dst."""
        for p, blk in enumerate(ids):
          off = lax.rem(j * bk + p * piece, geo.block_size)
          src = _kv_box(cache_ref, st, blk, t.h, off, piece, side)
          plgpu.copy_gmem_to_smem(src, dst.at[pl.ds(p * piece, piece)], bar)

      if st.ops is not None:            # a quantized cache read as stored: ragged_landing
        refs = (ts_ref, landing, land_bars, (k_smem, v_smem), (k_bars, v_bars),
                (k_free, v_free))
        produce_item(t, base, st, refs, block_ids, issue)
        return base + t.num_steps

      @pl.loop(t.j_lo, t.j_hi)
      def _steps(j):
        n = base + j - t.j_lo             # the block's step: its slot is reused from the
        slot = slot_of(n)                 # block's step `stages` on, once released
        ids = block_ids(j)

        @pl.when(n >= geo.stages)
        def _():
          plgpu.barrier_wait(k_free.at[slot])
        issue(j, k_smem.at[slot], k_bars.at[slot], 0, ids)

        @pl.when(n >= geo.stages)
        def _():
          plgpu.barrier_wait(v_free.at[slot])
        issue(j, v_smem.at[slot], v_bars.at[slot], 1, ids)
      return base + t.num_steps

    total = _for_each_item(st, item, jnp.int32(0))

    @pl.loop(jnp.maximum(total - geo.stages, 0), total)
    def _drain(n):   # the last `stages` releases: no barrier phase is left unobserved
      slot = slot_of(n)
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])


def ragged_attention_call(meta, block_table_flat, sinks, scale, q, cache, *,
                          st: KernelStatics, rt=None, tensor_scales=None):
  """Launch the kernel.

  meta: int32 ``[META_ROWS, num_tiles]`` (:func:`tiles.tile_metadata`); block_table_flat:
  int32 ``[S * max_blocks]``; sinks: float32 ``[Hq]`` (ignored without sinks); scale: float32
  ``[1]``, the softmax scale when it is traced (``st.scale`` None; the kernel's operand only
  then), else None; q:
  ``[T, Hq, D]``; cache: the physical cache; rt: with ``st.rotation``, the rotation's
  ``(D, D)`` matrix in q's dtype (:meth:`kvjax.rotation.Rotation.products`; q is then in the
  model's frame, and so is the output), else None; tensor_scales: with ``st.ops`` (the cache
  read as stored, :mod:`.ragged_landing`) float32 ``[2, H]``, else None. With
  ``st.interpret`` the kernel runs on CPU in Mosaic GPU interpret mode (warpgroups as
  threads, simulated TMA and barriers). Returns ``[T, Hq, D]`` in q's dtype.
  """
  geo = st.geo
  d = st.head_size
  q_copies = st.stage_chunks or 1     # per slab
  q_bars = tuple(plgpu.Barrier(num_arrivals=q_copies * len(geo.slabs(w)))
                 for w in range(geo.num_wgs))
  # a plain cache's K/V slots fill by TMA copies; a converted format's by the producer
  kv_bars = plgpu.Barrier(num_arrivals=1 if st.ops is not None else geo.pieces_per_step,
                          num_barriers=geo.stages)
  free_bars = plgpu.Barrier(num_arrivals=geo.num_wgs, num_barriers=geo.stages)
  staging = (plgpu.SMEM((geo.num_wgs, st.stage_chunks, TL.WG_ROWS, _SWIZZLE_ELEMS),
                        st.dtype, transforms=(plgpu.SwizzleTransform(_SWIZZLE),))
             if st.stage_chunks else plgpu.SMEM((geo.num_wgs, TL.WG_ROWS, d), st.dtype))
  smem = (_smem_tiled((geo.num_wgs, TL.WG_ROWS, d), st.dtype),
          staging,
          _smem_tiled((geo.stages, geo.block_kv, d), st.dtype),
          _smem_tiled((geo.stages, geo.block_kv, d), st.dtype),
          None if st.pv == TL.PV_REGS else
          _smem_tiled((geo.num_wgs, TL.WG_ROWS, geo.block_kv), st.dtype),
          staging if st.staging == TL.STAGING_Q_OWN else None)

  sched_bar = plgpu.Barrier(num_arrivals=2) if st.ping_pong and geo.num_wgs == 2 else None
  if st.rotation != (rt is not None):
    raise ValueError(f"the rotation's matrix operand goes with st.rotation={st.rotation}")
  rotation = ((_smem_tiled((d, d), st.dtype), plgpu.Barrier(num_arrivals=1)) if st.rotation
              else (None, None))

  if (st.ops is not None) != (tensor_scales is not None):
    raise ValueError(f"the tensor scales operand goes with a cache read as stored "
                     f"(st.ops={st.ops})")
  landing = landing_scratch(st, _smem_tiled)

  traced = st.scale is None     # the scale operand exists only then
  extra = (scale,) if traced else ()
  extra += (rt,) if st.rotation else ()
  extra += (tensor_scales,) if st.ops is not None else ()

  def kvjax_mgpu_ragged(meta_ref, bt_ref, sinks_ref, *refs):
    refs = list(refs)
    scale_ref = refs.pop(0) if traced else None
    rt_ref = refs.pop(0) if st.rotation else None
    ts_ref = refs.pop(0) if st.ops is not None else None
    q_ref, cache_ref, o_ref = refs
    pl.run_scoped(
        lambda *scratch: _kernel(meta_ref, bt_ref, sinks_ref, scale_ref, rt_ref, ts_ref, q_ref,
                                 cache_ref, o_ref, scratch, st=st),
        smem, q_bars, (kv_bars, kv_bars), (free_bars, free_bars), sched_bar, rotation,
        landing, collective_axes="wg")

  return plgpu.kernel(
      kvjax_mgpu_ragged,
      out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(st.grid_size,),
      grid_names=("program",),
      num_threads=geo.num_wgs + 1,
      thread_name="wg",
      interpret=interpret_params() if st.interpret else None,
      compiler_params=plgpu.CompilerParams(   # Lane semantics on every version: compat.py
          approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
  )(meta, block_table_flat, sinks, *extra, q, cache)
