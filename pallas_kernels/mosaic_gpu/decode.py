"""Mosaic GPU (Hopper) paged decode attention over the packed cache: one query per sequence.

Entry point :func:`paged_decode_attention`, the semantics of
:func:`pallas_kernels.triton.decode.paged_decode_attention` (causal, the query at position
``seq_len - 1``; GQA, sliding window, soft cap, sinks; rows of no sequence output 0).
:func:`decode_reason` says when it applies. The kernel (:mod:`.decode_kernel`) reads formats
through their Mosaic GPU hooks (:mod:`.formats`: plain bf16 / f16, fp8 per tensor;
:mod:`.row_formats`: int8 / fp8 / int4 per token-head, through :func:`cache_view`); its
partials (one per split) are merged here in XLA with the sinks.
Works under ``jax.jit`` with traced ``seq_lens``, ``block_table``, ``scale`` and scales.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp
import numpy as np

from kvjax.spec import KVCacheSpec
from pallas_kernels.common import cdiv, merge_splits
from pallas_kernels.mosaic_gpu import decode_geometry as DG
from pallas_kernels.mosaic_gpu import tuning as MT
from pallas_kernels.mosaic_gpu.adapters import ADAPTERS

_LN2 = math.log(2.0)


def decode_reason(spec: KVCacheSpec, q_dtype, group: Optional[int] = None) -> Optional[str]:
  """Why the decode kernel cannot take this spec / q dtype / GQA group (None: it can).
  Device-free."""
  cls = ADAPTERS.hooks(spec.codec)
  if cls is None:
    return ADAPTERS.reason(spec)
  why = cls.reason(spec, q_dtype)
  if why is not None:
    return why
  why = DG.head_size_reason(spec.head_size)
  if why is not None:
    return why
  if group is not None:
    return DG.group_reason(group, spec.num_kv_heads)
  return None


def decode_statics(spec: KVCacheSpec, q_dtype, num_rows: int, num_heads: int,
                   num_seqs: int, max_blocks: int, num_blocks: int, *, sliding_window=None,
                   soft_cap=None, sinks: bool = False, interpret: bool = False,
                   geometry=None, num_splits: Optional[int] = None,
                   finish: Optional[bool] = None, num_sms: Optional[int] = None,
                   layered: bool = False):
  """The kernel's statics (:class:`.decode_kernel.DecodeStatics`) for one call shape.

  num_rows: query rows; num_heads: Hq; num_seqs: S, sequences; max_blocks: the block
  table's width; num_blocks: the cache's. num_splits None: one with ``finish=True``, else
  :func:`.decode_geometry.num_splits_for` (on ``num_sms`` SMs, None: this process's GPU).
  finish None: the kernel writes the output itself when it runs one split. layered: the
  cache is a layered (5-D) array, the layer an operand. Raises ValueError when the kernel
  cannot take the call.
  """
  from pallas_kernels.mosaic_gpu import decode_kernel as DK   # noqa: PLC0415
  h = spec.num_kv_heads
  g = num_heads // h
  reason = decode_reason(spec, q_dtype, g)
  if reason is not None:
    raise ValueError(f"Mosaic GPU decode: {reason}")
  ops = dataclasses.replace(ADAPTERS.hooks(spec.codec).of(spec, q_dtype), ptx=not interpret)
  steps = cdiv(max_blocks * spec.block_size, DG.DecodeGeometry.block_kv)
  if num_splits is None and finish:
    num_splits = 1
  blocks_per_sm = MT.decode_blocks_per_sm(spec.cache_dtype)
  splits = int(num_splits or DG.num_splits_for(num_rows, h, steps, num_sms or MT.num_sms(),
                                               blocks_per_sm))
  finish = splits == 1 if finish is None else bool(finish)
  row_view = _row_view(spec) if ops.row_scaled else {}
  geo = geometry or DG.choose_geometry(
      ops, g, spec.block_size, spec.head_size, finish=finish,
      round_steps=max(row_view.get("tokens_per_row", 1), MT.DECODE_ROUND_STEPS),
      blocks_per_sm=blocks_per_sm)
  if geo.smem_bytes(ops, finish) > DG.SMEM_BUDGET:
    raise ValueError(f"geometry {geo} needs {geo.smem_bytes(ops, finish)} bytes of shared "
                     f"memory; the budget is {DG.SMEM_BUDGET}")
  return DK.DecodeStatics(
      geo=geo, ops=ops, num_kv_heads=h, layout=spec.layout, num_blocks=num_blocks,
      num_seqs=num_seqs, max_blocks=max_blocks, num_splits=splits,
      window=None if sliding_window is None else int(sliding_window),
      soft_cap=None if soft_cap is None else float(soft_cap), interpret=bool(interpret),
      finish=finish, sinks=bool(sinks) and finish,
      layer_axis=spec.layer_axis if layered else None, **row_view)


def _row_view(spec: KVCacheSpec) -> dict:
  """The statics of a row-scaled format's :func:`cache_view`: TMA wants every stride of a
  copy's source 16 bytes apart, so a view row holds one token where its rows are (2 tokens
  otherwise: a side row ``[D data | 4-byte scale]`` is a multiple of 8 bytes)."""
  c = spec.content_dim
  token_bytes = c * spec.itemsize * (spec.num_kv_heads if spec.layout == "NHD" else 1)
  return dict(tokens_per_row=1 if token_bytes % 16 == 0 else 2, side_dim=spec.padded_head_size,
              content_dim=c)


def cache_view_shape(shape, st) -> tuple:
  """The shape of :func:`cache_view` for a physical cache of ``shape``. Row-scaled formats:
  rows of ``r = st.tokens_per_row`` tokens, ``(B, N / r, r * H * C)`` for NHD,
  ``(B, H, N / r, r * C)`` for HND. Formats with group scales (nvfp4, HND ``(B, 2H, N, F)``):
  per block and side, rows of ``D/2`` bytes, ``(B, 2, H N F / (D/2), D/2)``
  (:mod:`.group_formats`). Other formats: ``shape``."""
  shape = tuple(shape)
  if st.ops.scale_copies:    # HND (B, 2H, N, F): per side, rows of D/2 bytes
    b, heads, n, f = shape
    w = st.geo.head_size // 2
    return (b, 2, heads // 2 * n * f // w, w)
  if not st.ops.row_scaled:
    return shape
  r = st.tokens_per_row
  if st.layout == "NHD":
    b, n, h, c = shape
    return (b, n // r, r * h * c)
  b, h, n, c = shape
  return (b, h, n // r, r * c)


def cache_view(cache, st):
  """The array a row-scaled format's kernel copies from (a reshape, no copy:
  :func:`cache_view_shape`). Other formats: the cache itself."""
  if not (st.ops.row_scaled or st.ops.scale_copies):
    return cache
  return cache.reshape(cache_view_shape(cache.shape, st))


def padded_heads(num_heads: int, geo) -> int:
  """Query heads the kernel's q (and sinks) must have: the kernel copies 16 query rows from
  a multiple of 8 (rows past Hq read as zeros), TMA wants a head count that is a multiple
  of 8, and at least the 16 rows of one copy."""
  return max(geo.cols, cdiv(num_heads, DG.ALIGN_ROWS) * DG.ALIGN_ROWS)


def sink_columns(sinks, num_heads_padded: int):
  """Sink logits float32 ``[Hq]`` as the kernel reads them in finish mode: log2 domain,
  padded to ``num_heads_padded`` with a finite floor (padded columns are discarded)."""
  x = jnp.asarray(sinks, jnp.float32) * math.log2(math.e)
  return jnp.pad(x, (0, num_heads_padded - x.shape[0]), constant_values=-1e30)


def paged_decode_attention(q, cache, spec: KVCacheSpec, *, seq_lens, block_table, scale,
                           sliding_window=None, soft_cap=None, sinks=None, k_scale=None,
                           v_scale=None, query_start_loc=None, interpret: bool = False,
                           geometry=None, num_splits: Optional[int] = None,
                           finish: Optional[bool] = None, layer=None):
  """Decode attention over the packed paged cache with the Mosaic GPU kernel.

  Args:
    q: ``[S, Hq, D]`` bfloat16 / float16, one query token per row; Hq = G * H.
    cache: the spec's physical array; spec: its :class:`kvjax.KVCacheSpec`.
    seq_lens: int32 ``[S]``; block_table: int32 ``[S, M]`` (traced or not).
    scale: softmax scale (float or traced scalar). sliding_window, soft_cap: static or None.
    sinks: float32 ``[Hq]`` sink logits or None. k_scale, v_scale: global scales (fp8).
    query_start_loc: int ``[S+1]`` or None (= ``arange(S+1)``), as the Triton decode path.
    interpret: Mosaic GPU interpret mode (CPU, jax >= 0.11).
    geometry: a :class:`.decode_geometry.DecodeGeometry` (None: chosen), num_splits: None =
      :func:`.decode_geometry.num_splits_for`; both for benchmark sweeps. finish: whether
      the kernel writes the output (one split only); None: when it runs one split, else
      the partials are merged in XLA.
    layer: None for one layer's cache; for a layered (5-D) cache, the layer attended over
      (an int or a traced int32 scalar: every layer runs one program).
  Returns:
    ``[S, Hq, D]`` in q's dtype.
  """
  from pallas_kernels.mosaic_gpu import decode_kernel as DK   # noqa: PLC0415
  num_rows, hq, d = q.shape
  h = spec.num_kv_heads
  g = hq // h
  max_blocks = block_table.shape[1]
  num_seqs = seq_lens.shape[0]
  num_blocks, num_layers = spec.blocks_and_layers(cache)
  if (layer is None) != (num_layers is None):
    raise ValueError(f"layer={layer!r} with a cache of shape {tuple(cache.shape)}: pass layer "
                     "for a layered cache, and only then")
  st = decode_statics(spec, q.dtype, num_rows, hq, num_seqs, max_blocks, num_blocks,
                      layered=layer is not None,
                      sliding_window=sliding_window, soft_cap=soft_cap,
                      sinks=sinks is not None, interpret=interpret, geometry=geometry,
                      num_splits=num_splits, finish=finish)
  geo, ops = st.geo, st.ops
  qsl = (jnp.arange(num_seqs + 1, dtype=jnp.int32) if query_start_loc is None
         else jnp.asarray(query_start_loc, jnp.int32))
  meta = (qsl, jnp.asarray(seq_lens, jnp.int32),
          jnp.asarray(block_table, jnp.int32).reshape(-1))
  scales = spec.codec.tensor_scales(k_scale, v_scale, h)               # [2, H]
  factors = (jnp.asarray(scale, jnp.float32) * math.log2(math.e)) * scales[0]
  qk = ops.q_operand(q)
  hq_pad = padded_heads(hq, geo)
  if hq_pad != hq:
    qk = jnp.pad(qk, ((0, 0), (0, hq_pad - hq), (0, 0)))
  if layer is not None:
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
  cache = cache_view(cache, st)
  q_sums = ops.q_sums(qk)
  if st.finish:
    out = DK.decode_call(*meta, factors, qk, cache, st=st, v_factors=scales[1], layer=layer,
                         sinks=None if sinks is None else sink_columns(sinks, hq_pad),
                         out_dtype=q.dtype, q_sums=q_sums)
    return ops.output(out)
  acc, ml = DK.decode_call(*meta, factors, qk, cache, st=st, layer=layer, q_sums=q_sums)
  # Head h's queries are columns col_offset(h) + [0, G) of the partials.
  cols = np.asarray([[geo.col_offset(i) + j for j in range(g)] for i in range(h)], np.int32)
  acc = jnp.take_along_axis(acc, cols[None, :, None, None, :], axis=-1)   # [S, H, P, D, G]
  ml = jnp.take_along_axis(ml, cols[None, :, None, None, :], axis=-1)     # [S, H, P, 2, G]
  sink_hg = None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(h, g)
  out = merge_splits(jnp.swapaxes(acc, -1, -2), ml[..., 0, :] * _LN2, ml[..., 1, :], sink_hg,
                     g)                                                # [S, H, G, D]
  out = out * scales[1][None, :, None, None]
  return ops.output(out.reshape(num_rows, hq, d).astype(q.dtype))
