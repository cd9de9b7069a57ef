"""Ragged attention from torch: kvjax's Mosaic GPU ragged kernel launched on torch's stream.

:class:`TorchRagged` runs :mod:`pallas_kernels.mosaic_gpu.kernel` (prefills with a cached
prefix and decodes in one batch) on torch tensors over a bf16 / f16 cache, writing into the
caller's output: the per-tile schedule the kernel reads (:func:`tile_metadata`, the torch
counterpart of :func:`pallas_kernels.mosaic_gpu.tiles.tile_metadata`) is a few torch ops,
then one launch on ``torch.cuda.current_stream()`` (:mod:`torch_bridge.mosaic_launch`). No
host synchronization. Kernels compile once per (tokens, sequences, block-table width, cache
blocks, max_query_len bucket, causal).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

from kvjax import plain_copy as PC
from kvjax.spec import KVCacheSpec
from pallas_kernels import ragged_schedule as sched
from pallas_kernels.mosaic_gpu import ragged_attention as MR
from pallas_kernels.mosaic_gpu import tiles as TL
from torch_bridge import dtypes
from torch_bridge import mosaic_launch as ML


def spec_reason(spec: KVCacheSpec, q_dtype, num_heads: int) -> Optional[str]:
  """None when the ragged kernel reads ``spec``'s cache in place from torch (a plain 16-bit
  cache of q's dtype; other formats need a plain copy of the pages, which runs in JAX),
  else why not. Device-free."""
  if not PC.is_plain(spec):
    return (f"cache dtype {spec.cache_dtype!r}: the ragged kernel reads it through a plain "
            "copy of the pages, made in JAX")
  if num_heads % spec.num_kv_heads:
    return f"num_heads={num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}"
  return MR.spec_reason(spec, dtypes.numpy_dtype(q_dtype), num_heads // spec.num_kv_heads)


def tile_metadata(query_start_loc, seq_lens, block_table_width: int, num_tokens: int,
                  num_tiles: int, bq: int, tile_ids: torch.Tensor) -> torch.Tensor:
  """Per-tile scalars, int32 ``[META_ROWS, num_tiles]``, by torch ops: the values of
  :func:`pallas_kernels.mosaic_gpu.tiles.tile_metadata` (tests check they are equal).

  query_start_loc int32 ``[S+1]``, seq_lens int32 ``[S]``; tile_ids: int32
  ``arange(num_tiles)`` on their device (kept by the caller).
  """
  num_seqs = seq_lens.shape[0]
  end = torch.full((1,), num_tokens, dtype=torch.int32, device=query_start_loc.device)
  qsl = torch.cat([query_start_loc, end])                      # [S+2]: the padding sequence
  q_len = (qsl[1:] - qsl[:-1]).clamp_(min=0)                    # [S+1]
  tiles = torch.div(q_len + (bq - 1), bq, rounding_mode="floor")
  ends = torch.cumsum(tiles, 0, dtype=torch.int32)
  seq = torch.searchsorted(ends, tile_ids, right=True).to(torch.int32)
  seq = torch.minimum(seq, torch.tensor(num_seqs, dtype=torch.int32, device=seq.device))
  q0 = (tile_ids - (ends - tiles)[seq]) * bq                   # seq == S: padding tokens
  q_len_t = q_len[seq]
  nq = (q_len_t - q0).clamp_(0, bq)
  real_seq = seq.clamp(max=num_seqs - 1)
  kv_len = torch.where(seq >= num_seqs, 0, seq_lens[real_seq])
  tok0 = torch.where(nq > 0, qsl[seq] + q0, num_tokens)
  pos0 = torch.where(nq > 0, kv_len - q_len_t + q0, 0)
  return torch.stack([tok0, nq, pos0, kv_len, real_seq * block_table_width]).to(torch.int32)


class TorchRagged(ML.AttentionLaunch):
  """Ragged attention of one layer configuration over a plain cache, launched from torch
  (arguments: :class:`torch_bridge.mosaic_launch.AttentionLaunch`)."""

  def _launch(self, q, num_seqs, max_blocks, num_blocks, max_query_len, causal):
    key = (tuple(q.shape), q.dtype, q.device, num_seqs, max_blocks, num_blocks,
           sched.next_pow2(max(1, max_query_len)), bool(causal))
    got = self._compiled.get(key)
    if got is None:
      from pallas_kernels.mosaic_gpu import kernel as K   # noqa: PLC0415
      spec, device = self.spec, q.device
      t, hq, d = q.shape
      st = MR.ragged_statics(
          spec, dtypes.numpy_dtype(q.dtype), t, hq, num_seqs, max_blocks, num_blocks,
          scale=self.scale, causal=causal, sliding_window=self.window,
          soft_cap=self.soft_cap, sinks=self.sinks is not None, max_query_len=max_query_len,
          num_programs=torch.cuda.get_device_properties(device).multi_processor_count)
      structs = (jax.ShapeDtypeStruct((TL.META_ROWS, st.num_tiles), jnp.int32),
                 jax.ShapeDtypeStruct((num_seqs * max_blocks,), jnp.int32),
                 jax.ShapeDtypeStruct((hq,), jnp.float32),
                 jax.ShapeDtypeStruct(q.shape, dtypes.numpy_dtype(q.dtype)),
                 jax.ShapeDtypeStruct(spec.physical_shape(num_blocks), spec.storage_dtype))
      module = ML.kernel_module(
          lambda meta, bt, sk, qq, cache: K.ragged_attention_call(meta, bt, sk, None, qq,
                                                                   cache, st=st), *structs)
      got = self._compiled[key] = (ML.TorchLaunch(module, device), st)
    return got

  def __call__(self, q, cache, query_start_loc, seq_lens, block_table, out, max_query_len,
               causal=True):
    """Attention of ``q`` ``[T, Hq, D]`` over ``cache`` (the physical 4-D torch tensor),
    into ``out`` (contiguous ``[T, Hq, D]`` of q's dtype): query_start_loc int32 ``[S+1]``,
    seq_lens int32 ``[S]``, block_table int32 ``[S, M]``, contiguous on q's device;
    max_query_len: a bound on every sequence's query tokens (a Python int). Returns
    ``out``."""
    num_seqs, max_blocks = block_table.shape
    if q.shape[0] == 0 or num_seqs == 0:
      return out.zero_()
    launch, st = self._launch(q, num_seqs, max_blocks, cache.shape[0], max_query_len, causal)
    device = q.device
    ids = self._const(("tiles", device, st.num_tiles), lambda: torch.arange(
        st.num_tiles, dtype=torch.int32, device=device))
    meta = tile_metadata(query_start_loc, seq_lens, max_blocks, q.shape[0], st.num_tiles,
                         st.geo.bq, ids)
    sinks = self._const(("sinks", device), lambda: torch.as_tensor(
        np.zeros(self.num_heads, np.float32) if self.sinks is None else self.sinks,
        device=device))
    launch.launch(meta, block_table.view(-1), sinks, q.contiguous(), cache, out)
    return out
