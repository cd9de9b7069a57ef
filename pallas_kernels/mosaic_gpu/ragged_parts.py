"""Pieces of the Mosaic GPU ragged kernel body (:mod:`.kernel`): ``acc += P V`` in each of its
variants, the products that rotate q and un-rotate the output of a rotated format, and the
staging and TMA stores of a tile's output rows."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu import tiles as TL
from pallas_kernels.mosaic_gpu.kernel_statics import SWIZZLE_ELEMS as _SWIZZLE_ELEMS


def accumulate_pv(acc, p16, v_ref, p_ref, pv: str, while_running):
  """``acc + p16 @ v_ref`` with wgmma, issued as the variant ``pv`` (``tiles.PV_VARIANTS``).

  acc: float32 ``(64, D)`` (WGMMA layout); p16: ``(64, block_kv)`` in q's dtype; v_ref: the
  ``(block_kv, D)`` V slot; p_ref: this warpgroup's ``(64, block_kv)`` P buffer (None for
  "p_regs"); while_running: called once the wgmma is issued, before it is waited for.
  Every variant returns only after its wgmma has completed (``run_state`` / reading the
  accumulator wait for it), so the caller may release the V slot and the next step may
  overwrite ``p_ref``.
  """
  if pv == TL.PV_REGS:
    def pv_in_place(acc_ref):
      plgpu.wgmma(acc_ref, p16, v_ref)
      while_running()
    return pl.run_state(pv_in_place)(plgpu.ACC.init(acc))

  p_ref[...] = p16
  plgpu.commit_smem()      # generic-proxy stores visible to wgmma (async proxy)
  if pv == TL.PV_SMEM:
    def pv_smem_in_place(acc_ref):
      plgpu.wgmma(acc_ref, p_ref, v_ref)
      while_running()
    return pl.run_state(pv_smem_in_place)(plgpu.ACC.init(acc))

  def pv_fresh(acc_ref):
    plgpu.wgmma(acc_ref, p_ref, v_ref)
    while_running()
    return acc_ref[...]
  return acc + pl.run_scoped(pv_fresh, plgpu.ACC(acc.shape, jnp.float32))


def rotate_rows(q_ref, rt_ref, dtype):
  """``q_ref <- dtype(q_ref @ rt_ref^T)`` in place: a warpgroup's ``(64, D)`` q rows in the
  format's rotated frame (``rt_ref``: the ``(D, D)`` matrix of
  :meth:`kvjax.rotation.Rotation.products`, in shared memory), accumulated in float32."""
  def product(acc_ref):
    plgpu.wgmma(acc_ref, q_ref, rt_ref.transpose((1, 0)))
    return acc_ref[...]
  x = pl.run_scoped(product, plgpu.ACC(q_ref.shape, jnp.float32))
  q_ref[...] = x.astype(dtype)
  plgpu.commit_smem()      # generic-proxy stores visible to the key steps' wgmma


def unrotate_rows(out, buf_ref, rt_ref, dtype, factor: float):
  """``(dtype(out) @ rt_ref) * factor`` (float32, WGMMA layout): a warpgroup's ``(64, D)``
  output rows back in the model's frame, rounded to ``dtype`` first as a kernel without the
  rotation would store them; ``buf_ref`` ``(64, D)``: shared memory the rows pass through
  (the warpgroup's q buffer, free once its last key step is done)."""
  buf_ref[...] = out.astype(dtype)
  plgpu.commit_smem()

  def product(acc_ref):
    plgpu.wgmma(acc_ref, buf_ref, rt_ref)
    return acc_ref[...]
  return pl.run_scoped(product, plgpu.ACC(out.shape, jnp.float32)) * factor


def store_rows(o_stage, o_ref, sl: TL.Slab, tok0, nq, head, chunks: int):
  """TMA-store the slab's real rows (``clip(nq - sl.tok, 0, sl.n)`` of them) as pieces of
  ``sl.n, sl.n/2, ..., 1`` rows: the TMA box is static, the row count is not. o_stage: the
  warpgroup's ``(64, D)`` staging rows, or (``chunks > 0``) its ``(chunks, 64, 64)``
  swizzled 64-column chunks, one store per chunk."""
  count = jnp.clip(nq - sl.tok, 0, sl.n)
  start = jnp.int32(0)
  size = sl.n
  while size >= 1:
    @pl.when((count & size) != 0)
    def _piece(size=size, start=start):
      rows = pl.ds(sl.row + start, size)
      dst = o_ref.at[pl.ds(tok0 + sl.tok + start, size), head]
      if not chunks:
        plgpu.copy_smem_to_gmem(o_stage.at[rows], dst)
      for c in range(chunks):
        plgpu.copy_smem_to_gmem(o_stage.at[c, rows],
                                dst.at[:, pl.ds(c * _SWIZZLE_ELEMS, _SWIZZLE_ELEMS)])
    start = start + (count & size)
    size //= 2


def store_output(out, dtype, o_smem, o_ref, wg, geo: TL.TileGeometry, tok0, nq, head0,
                 chunks: int):
  """Stage warpgroup ``wg``'s ``(64, D)`` output rows ``out`` (float32, WGMMA layout) as
  ``dtype`` in its part of the output staging buffer ``o_smem`` and TMA-store the real rows
  of each of its slabs to ``o_ref`` ``[T, Hq, D]`` (heads ``head0 + slab.g``, tokens from
  ``tok0``, ``nq`` real). Returns once the stores are issued (not awaited)."""
  if not chunks:            # rows 2D bytes apart: the stores are bank-conflicted
    o_smem.at[wg][...] = out.astype(dtype)
  for c in range(chunks):
    o_smem.at[wg, c][...] = out[:, c * _SWIZZLE_ELEMS:(c + 1) * _SWIZZLE_ELEMS].astype(dtype)
  plgpu.commit_smem()
  for w in range(geo.num_wgs):
    @pl.when(wg == w)
    def _store():
      for sl in geo.slabs(w):
        store_rows(o_smem.at[w], o_ref, sl, tok0, nq, head0 + sl.g, chunks)
