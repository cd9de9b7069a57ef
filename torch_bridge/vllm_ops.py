"""vLLM's two kernel entry points over kvjax: ``reshape_and_cache_flash`` and
``unified_attention``, with vLLM's argument names and order, on torch tensors.

They take vLLM's K / V views of a packed cache (``key_cache`` / ``value_cache``
``(B, N, H, D)``, the two halves of one ``(B, H, N, 2D)`` logical cache in either stride
order) and find the packed tensor behind them: both views must be the K and V halves of
one cache (:func:`packed_cache`); separately allocated K and V caches are refused.
Each call runs :class:`torch_bridge.PagedAttentionBackend` (kept per configuration), so it
takes the paths the facade takes: on a Hopper GPU the Mosaic GPU kernels launched on
torch's current stream (decode attention, prefills of 128 tokens or more over bf16 / f16
caches, bf16 / f16 / fp8-per-tensor writes; capturable in CUDA graphs), else kvjax's JAX
ops. Launched calls use the given metadata as it is (no padding, nothing computed on the
host).

What vLLM's functions take and kvjax does not (ALiBi, fp8 queries, output scales, per-seq
causal flags, prefix ranges, ...) is refused with a ValueError naming the argument.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from torch_bridge.backend import PagedAttentionBackend
from torch_bridge.metadata import PagedAttentionMetadata

_FP8 = (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
_CACHE_DTYPES = {"auto": "auto", "bfloat16": "auto", "float16": "auto", "fp8": "fp8",
                 "fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}


def packed_cache(key_cache: torch.Tensor, value_cache: torch.Tensor):
  """The packed cache behind vLLM's K and V views: ``(physical tensor, layout)``.

  key_cache, value_cache: ``(B, N, H, D)`` views with equal shapes, dtypes and strides, V
  starting D elements after K, strides those of the K / V halves of a contiguous
  ``(B, N, H, 2D)`` (NHD) or ``(B, H, N, 2D)`` (HND) buffer. The physical tensor is a view
  of the same memory (no copy). Raises ValueError naming what differs.
  """
  for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
    if not isinstance(t, torch.Tensor) or t.ndim != 4:
      raise ValueError(f"{name} must be a 4-D (num_blocks, block_size, num_kv_heads, "
                       f"head_size) tensor, got {getattr(t, 'shape', type(t).__name__)}")
  if (key_cache.shape, key_cache.stride(), key_cache.dtype) != (
      value_cache.shape, value_cache.stride(), value_cache.dtype):
    raise ValueError("key_cache and value_cache must have equal shapes, strides and dtypes, "
                     f"got {tuple(key_cache.shape)} {key_cache.stride()} {key_cache.dtype} "
                     f"and {tuple(value_cache.shape)} {value_cache.stride()} "
                     f"{value_cache.dtype}")
  b, n, h, d = key_cache.shape
  if (value_cache.storage_offset() - key_cache.storage_offset() != d
      or value_cache.untyped_storage().data_ptr() != key_cache.untyped_storage().data_ptr()):
    raise ValueError("key_cache and value_cache must be the K and V halves of one packed "
                     f"cache: V must start {d} elements after K in the same storage")
  layouts = {"NHD": ((b, n, h, 2 * d), (n * h * 2 * d, h * 2 * d, 2 * d, 1)),
             "HND": ((b, h, n, 2 * d), (h * n * 2 * d, n * 2 * d, 2 * d, 1))}
  for layout, (shape, strides) in layouts.items():
    # K view (B, N, H, D) of the physical buffer: its (B, N, H) strides in that order
    want = strides if layout == "NHD" else (strides[0], strides[2], strides[1], 1)
    if all(size == 1 or got == w for size, got, w in zip(key_cache.shape, key_cache.stride(),
                                                        want)):
      phys = torch.as_strided(key_cache, shape, strides, key_cache.storage_offset())
      return phys, layout
  raise ValueError(f"key_cache strides {key_cache.stride()} are not those of the K half of a "
                   f"packed NHD or HND cache of shape {tuple(key_cache.shape)}")


@functools.lru_cache(maxsize=256)
def _backend(num_heads, num_kv_heads, head_size, block_size, cache_dtype, layout, dtype,
             scale, window, soft_cap, sinks_key) -> PagedAttentionBackend:
  sinks = None if sinks_key is None else np.asarray(sinks_key[1], np.float32)
  return PagedAttentionBackend(num_heads, num_kv_heads, head_size, block_size, cache_dtype,
                               layout, dtype=dtype, scale=scale, sliding_window=window,
                               soft_cap=soft_cap, sinks=sinks)


def _cache_dtype_of(cache: torch.Tensor, kv_cache_dtype: Optional[str] = None) -> str:
  if kv_cache_dtype is not None:
    try:
      return _CACHE_DTYPES[kv_cache_dtype]
    except KeyError:
      raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of "
                       f"{sorted(_CACHE_DTYPES)}") from None
  if cache.dtype == torch.float8_e5m2:
    return "fp8_e5m2"
  return "fp8" if cache.dtype in _FP8 else "auto"


def _per_head(scale, name: str, num_kv_heads: int):
  """A vLLM scale (None, float, tensor ``[]`` / ``[1]`` / ``[H]``, or ``[S, H]`` expanded
  from one value per head) as the facade takes it."""
  if scale is None or isinstance(scale, (int, float)):
    return scale
  if scale.ndim == 2:          # vLLM's (num_seqs, num_kv_heads) expand of the layer's scale
    return scale[0]
  if scale.numel() not in (1, num_kv_heads):
    raise ValueError(f"{name} must hold one scale or one per KV head ({num_kv_heads}), got "
                     f"shape {tuple(scale.shape)}")
  return scale


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale, v_scale) -> None:
  """Write ``key`` / ``value`` ``[T, H, D]`` into the packed cache behind ``key_cache`` /
  ``value_cache`` at ``slot_mapping`` (``[T']``, T' <= T; negative: skipped), quantizing
  for fp8 caches (``kv_cache_dtype`` "fp8" / "fp8_e4m3" / "fp8_e5m2"; "auto": the model
  dtype). vLLM's function of that name, same arguments."""
  phys, layout = packed_cache(key_cache, value_cache)
  _, n, h, d = key_cache.shape
  be = _backend(h, h, d, n, _cache_dtype_of(key_cache, kv_cache_dtype), layout, key.dtype,
                None, None, None, None)
  be.do_kv_cache_update(key, value, phys, slot_mapping, _per_head(k_scale, "k_scale", h),
                        _per_head(v_scale, "v_scale", h))


def _refuse(**given):
  for name, value in given.items():
    if value is not None and value is not False and not (name == "chunk_lookback"
                                                         and value == -1):
      raise ValueError(f"{name}={value!r}: kvjax's unified_attention does not take it")


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                      softmax_scale, causal, window_size, block_table, softcap, q_descale,
                      k_descale, v_descale, seq_threshold_3D=None,
                      num_par_softmax_segments=None, softmax_segm_output=None,
                      softmax_segm_max=None, softmax_segm_expsum=None, alibi_slopes=None,
                      output_scale=None, qq_bias=None, sinks=None, mm_prefix_range=None,
                      rswa_prefix_lens=None, rswa_window=None, use_alibi_sqrt=False,
                      kv_quant_mode=None, k_scale_cache=None, v_scale_cache=None,
                      chunk_lookback=-1, **_ignored) -> None:
  """Paged attention of ``q`` ``[T, Hq, D]`` over the packed cache behind ``k`` / ``v``
  (vLLM's K / V views), written into ``out`` ``[T, Hq, D]``; vLLM's function of that name,
  same arguments.

  cu_seqlens_q int ``[S+1]``, seqused_k int ``[S]``, block_table int ``[S, M]``;
  max_seqlen_q / max_seqlen_k: Python ints; window_size: ``(left, right)`` with
  ``(-1, -1)`` for none and ``(w - 1, 0)`` for a window of w keys; softcap: 0 for none;
  k_descale / v_descale: the fp8 cache's scales (one, one per KV head, or vLLM's
  ``[S, H]`` expand of those); q_descale must be None (queries are bf16 / f16); sinks:
  float32 ``[Hq]`` (read once per tensor: keep the same tensor for a layer). The split
  buffers (``seq_threshold_3D``, ``softmax_segm_*``) are vLLM's scratch: ignored.
  """
  _refuse(q_descale=q_descale, alibi_slopes=alibi_slopes, output_scale=output_scale,
          qq_bias=qq_bias, mm_prefix_range=mm_prefix_range, rswa_prefix_lens=rswa_prefix_lens,
          rswa_window=rswa_window, use_alibi_sqrt=use_alibi_sqrt, k_scale_cache=k_scale_cache,
          v_scale_cache=v_scale_cache, chunk_lookback=chunk_lookback)
  if kv_quant_mode is not None and int(kv_quant_mode) not in (0, 1):
    raise ValueError(f"kv_quant_mode={kv_quant_mode!r}: kvjax's unified_attention reads "
                     "plain and fp8 per-tensor caches (NONE, FP8_PER_TENSOR)")
  if isinstance(causal, torch.Tensor):
    raise ValueError("causal must be a bool (per-sequence causal flags are not taken)")
  left, right = window_size
  if right not in (-1, 0) or (right == -1) != (left == -1):
    raise ValueError(f"window_size={tuple(window_size)} must be (-1, -1) or (w - 1, 0)")
  phys, layout = packed_cache(k, v)
  _, n, h, d = k.shape
  hq = q.shape[1]
  sinks_key = None if sinks is None else _sink_values(sinks)
  be = _backend(hq, h, d, n, _cache_dtype_of(k), layout, q.dtype, float(softmax_scale),
                None if left == -1 else left + 1, float(softcap) if softcap else None,
                sinks_key)
  ks = _per_head(k_descale, "k_descale", h)
  vs = _per_head(v_descale, "v_descale", h)
  md = PagedAttentionMetadata(cu_seqlens_q, seqused_k, block_table, _no_slots(q.device),
                              int(max_seqlen_q), int(max_seqlen_k), bool(causal))
  be.forward(q, phys, md, out, k_scale=ks, v_scale=vs)


_SINKS = {}


def _sink_values(sinks: torch.Tensor):
  """(address, values) of a sinks tensor, read to the host once per tensor (a layer's
  sinks are its weights: later calls, inside a CUDA graph capture too, read nothing)."""
  key = (sinks.data_ptr(), sinks.device, tuple(sinks.shape))
  got = _SINKS.get(key)
  if got is None:
    got = _SINKS[key] = (key[0], tuple(sinks.detach().float().cpu().tolist()))
  return got


@functools.lru_cache(maxsize=16)
def _no_slots(device) -> torch.Tensor:
  return torch.empty((0,), dtype=torch.int32, device=device)
