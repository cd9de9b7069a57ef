"""Cache writes from torch: kvjax's Mosaic GPU row-store kernel launched on torch's stream.

:class:`TorchWrite` stores a step's K / V rows at their slots in a packed torch cache, in
place: bf16 / f16 caches take the rows as they are; fp8 per-tensor caches get them quantized
by torch ops first (``x * (1 / scale)``, saturated at the format's largest finite value,
cast: kvjax's formula, :func:`kvjax.quant.quantize_fp8_per_tensor`). Then one launch of
:mod:`pallas_kernels.mosaic_gpu.write` on ``torch.cuda.current_stream()``: no JAX dispatch,
no host synchronization, capturable in a CUDA graph. Kernels compile once per (token count,
cache blocks).
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

from kvjax import adapters
from kvjax import quant
from kvjax.spec import KVCacheSpec
from pallas_kernels.common import SIXTEEN_BIT
from torch_bridge import dtypes
from torch_bridge import mosaic_launch as ML


def spec_reason(spec: KVCacheSpec) -> Optional[str]:
  """None when the row-store kernel writes ``spec``'s cache from torch, else why not."""
  codec, storage = spec.codec, np.dtype(spec.storage_dtype)
  plain = codec.content_halves and codec.is_plain and storage in SIXTEEN_BIT
  fp8 = (codec.content_halves and codec.has_tensor_scales and not codec.has_row_scales
         and adapters.stores_fp8(codec))
  if not (plain or fp8):
    return (f"cache dtype {spec.cache_dtype!r}: the torch-launched write stores bf16 / f16 "
            "and fp8 per-tensor rows")
  row = spec.num_kv_heads * spec.head_size * storage.itemsize
  if row % 128:      # Mosaic GPU splits a copy over the warpgroup's 128 threads
    return (f"{spec.num_kv_heads} KV heads x head_size={spec.head_size} of {storage}: a "
            f"token's K row of {row} bytes is not a multiple of 128")
  return None


class TorchWrite:
  """Writes of one cache configuration, launched from torch."""

  def __init__(self, spec: KVCacheSpec):
    self.spec = spec
    self._fp8 = adapters.stores_fp8(spec.codec)
    self._storage = dtypes.torch_dtype(spec.storage_dtype)
    self._compiled = {}
    self._layers = {}        # (device, layer) -> the layer as an int32 [1] tensor

  def _launch(self, tokens: int, cache_shape: tuple, device) -> ML.TorchLaunch:
    key = (tokens, cache_shape, device)
    launch = self._compiled.get(key)
    if launch is None:
      from pallas_kernels.mosaic_gpu.write import write_rows   # noqa: PLC0415
      spec = self.spec
      rows = jax.ShapeDtypeStruct((tokens, spec.num_kv_heads, spec.head_size),
                                  spec.storage_dtype)
      structs = [jax.ShapeDtypeStruct((tokens,), jnp.int32), rows, rows,
                 jax.ShapeDtypeStruct(cache_shape, spec.storage_dtype)]
      if len(cache_shape) == 5:                # layered: the layer is an operand
        structs.append(jax.ShapeDtypeStruct((1,), jnp.int32))
        fn = lambda s, k, v, c, li: write_rows(c, k, v, s, spec, layer=li)   # noqa: E731
      else:
        fn = lambda s, k, v, c: write_rows(c, k, v, s, spec)                 # noqa: E731
      launch = self._compiled[key] = ML.TorchLaunch(ML.kernel_module(fn, *structs), device)
    return launch

  def _quantized(self, x, scale):
    """fp8 rows of ``x`` ``[T, H, D]``: ``x * (1 / scale)`` saturated, cast."""
    h = self.spec.num_kv_heads
    if scale is None or isinstance(scale, (int, float)):
      inv = 1.0 / (1.0 if scale is None else float(scale))
      y = x.float() * inv
    else:
      inv = 1.0 / scale.reshape(-1).float().expand(h)
      y = x.float() * inv[:, None]
    m = float(quant.finite_max(self.spec.storage_dtype))
    return y.clamp_(-m, m).to(self._storage)

  def __call__(self, key, value, cache, slots, k_scale=None, v_scale=None,
               layer=None) -> None:
    """Store ``key`` / ``value`` ``[T, H, D]`` (the model dtype, contiguous) at ``slots``
    (int32 ``[T]``, contiguous; outside ``[0, B * N)``: skipped) of ``cache`` (the physical
    torch tensor, uint8 for fp8 is fine: one layer's, or layered with ``layer`` a Python
    int), in place. k_scale, v_scale: None, floats or float32 tensors of one scale or one
    per KV head (fp8)."""
    if key.shape[0] == 0:
      return
    if self._fp8:
      key, value = self._quantized(key, k_scale), self._quantized(value, v_scale)
    elif key.dtype != self._storage:                  # a plain cache of another 16-bit dtype
      key, value = key.to(self._storage), value.to(self._storage)
    cache = cache.view(self._storage)
    ids = ()
    if layer is not None:
      ids = self._layers.get((key.device, layer))
      if ids is None:
        ids = self._layers[(key.device, layer)] = (
            torch.tensor([layer], dtype=torch.int32, device=key.device),)
    self._launch(key.shape[0], tuple(cache.shape), key.device).launch(
        slots, key, value, cache, *ids, cache)
