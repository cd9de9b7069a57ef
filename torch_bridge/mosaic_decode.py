"""Decode attention from torch: kvjax's Mosaic GPU decode kernel launched on torch's stream.

:class:`TorchDecode` runs :mod:`pallas_kernels.mosaic_gpu.decode_kernel` on torch tensors
(the packed cache, a decode step's int32 metadata, the query) and writes into the caller's
output: plain, fp8 per-tensor and int8 / fp8 per-token-head caches (these through a view of
the cache with rows 16 bytes apart, :func:`pallas_kernels.mosaic_gpu.decode.cache_view_shape`,
no copy). A call is one kernel launch on ``torch.cuda.current_stream()``
(:mod:`torch_bridge.mosaic_launch`), plus a few torch ops where they are due: a padded /
float16 copy of the query (a head count the kernel's 16-row copies do not tile, an fp8 cache
read with float16 operands), the K / V scale factors when they are tensors, and the merge
of split partials (only for block tables of at least ``2 * MIN_STEPS_PER_SPLIT`` key steps;
shorter ones run one split and the kernel writes the output itself). No host
synchronization: a call can be captured in a CUDA graph and replayed with new contents in
the same tensors.

Kernels compile once per (query rows, sequences, block-table width, cache blocks) and are
kept per instance.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

from kvjax.spec import KVCacheSpec
from pallas_kernels.mosaic_gpu import decode as MD
from pallas_kernels.mosaic_gpu import decode_geometry as DG
from pallas_kernels.mosaic_gpu import tuning as MT
from pallas_kernels.mosaic_gpu.compat import JAX_VERSION
from torch_bridge import dtypes
from torch_bridge import mosaic_launch as ML

#: Key steps (of 64 keys) a split must have before the direct path splits a sequence: a
#: split adds its partials' merge (about ten small torch ops) to the call.
MIN_STEPS_PER_SPLIT = 32
_LOG2E = math.log2(math.e)
_F16_MAX = 65504.0


def platform_reason(device) -> Optional[str]:
  """None when kernels can be launched from torch on ``device``: a CUDA device of compute
  capability 9.0 or more (Hopper), jax >= 0.11 (Mosaic GPU's compiler entry point), else
  why not."""
  device = torch.device(device)
  if device.type != "cuda":
    return f"tensors on {device}: kernels launch from torch on CUDA devices only"
  if JAX_VERSION < (0, 11):
    return f"jax {jax.__version__}: launching Mosaic GPU kernels from torch needs jax >= 0.11"
  major, minor = torch.cuda.get_device_capability(device)
  if major < 9:
    return f"compute capability {major}.{minor}: the Mosaic GPU kernels need 9.0 (Hopper) or more"
  return None


def spec_reason(spec: KVCacheSpec, q_dtype, num_heads: int) -> Optional[str]:
  """None when the decode kernel reads ``spec``'s cache with ``num_heads`` query heads of
  ``q_dtype`` (torch or numpy), else why not. Device-free."""
  if num_heads % spec.num_kv_heads:
    return f"num_heads={num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}"
  hooks = MD.ADAPTERS.hooks(spec.codec)
  if hooks is not None and (hooks.num_q_sums or hooks.scale_copies):   # int4, nvfp4
    return (f"cache_dtype={spec.cache_dtype!r}: its decode through JAX (the Triton kernel) is "
            "faster than the Mosaic GPU decode kernel launched from torch (measured)")
  return MD.decode_reason(spec, dtypes.numpy_dtype(q_dtype), num_heads // spec.num_kv_heads)


def layered_reason(spec: KVCacheSpec) -> Optional[str]:
  """None when the decode kernel reads a layered (5-D) cache of ``spec`` in place, else why
  not (a per-token-head format: its kernel reads one layer's cache)."""
  hooks = MD.ADAPTERS.hooks(spec.codec)
  if hooks is not None and hooks.row_scaled:
    return (f"a layered {spec.cache_dtype} cache: the decode kernel reads one layer's cache of "
            "a per-token-head format")
  return None


@dataclasses.dataclass
class _Compiled:
  """One compiled shape: the launcher, its statics, and the buffers it owns."""
  launch: ML.TorchLaunch
  st: object
  heads_padded: int
  q_buf: Optional[torch.Tensor]          # padded / float16 query, when q is not the operand
  partials: Optional[tuple]              # (acc, ml) buffers of a split call
  out_buf: Optional[torch.Tensor]        # the output when the caller's is not contiguous


class TorchDecode(ML.AttentionLaunch):
  """Decode attention of one layer configuration, launched from torch (arguments:
  :class:`torch_bridge.mosaic_launch.AttentionLaunch`)."""

  # -- compiled shapes -----------------------------------------------------------------------
  def _statics(self, q_dtype, rows, num_seqs, max_blocks, num_blocks, layered, device):
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    steps = -(-max_blocks * self.spec.block_size // DG.DecodeGeometry.block_kv)
    h = self.spec.num_kv_heads
    blocks = MT.decode_blocks_per_sm(self.spec.cache_dtype)
    splits = min(DG.num_splits_for(rows, h, steps, sms, blocks),
                 max(1, steps // MIN_STEPS_PER_SPLIT))
    return MD.decode_statics(self.spec, q_dtype, rows, self.num_heads, num_seqs, max_blocks,
                             num_blocks, sliding_window=self.window, soft_cap=self.soft_cap,
                             sinks=self.sinks is not None, num_splits=splits, layered=layered)

  def _compile(self, q, num_seqs, max_blocks, cache_shape) -> _Compiled:
    from pallas_kernels.mosaic_gpu import decode_kernel as DK   # noqa: PLC0415
    spec, device = self.spec, q.device
    q_np = dtypes.numpy_dtype(q.dtype)
    rows, hq, d = q.shape
    layered = len(cache_shape) == 5
    st = self._statics(q_np, rows, num_seqs, max_blocks, cache_shape[0], layered, device)
    hq_pad = MD.padded_heads(hq, st.geo)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)     # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)   # noqa: E731
    h = spec.num_kv_heads
    structs = [i32(num_seqs + 1), i32(num_seqs), i32(num_seqs * max_blocks), f32(h)]
    if st.finish:
      structs.append(f32(h))
      if st.sinks:
        structs.append(f32(hq_pad))
    structs += [jax.ShapeDtypeStruct((rows, hq_pad, d), st.ops.compute),
                jax.ShapeDtypeStruct(MD.cache_view_shape(cache_shape, st), spec.storage_dtype)]
    if layered:
      structs.append(i32(1))

    def fn(qsl, sl, bt, fac, *rest):      # the kernel's operands, in decode_call's order
      rest = list(rest)
      layer = rest.pop() if layered else None
      q_op, cache = rest[-2:]
      if not st.finish:
        return DK.decode_call(qsl, sl, bt, fac, q_op, cache, st=st, layer=layer)
      return DK.decode_call(qsl, sl, bt, fac, q_op, cache, st=st, v_factors=rest[0],
                            sinks=rest[1] if st.sinks else None, out_dtype=q_np, layer=layer)
    launch = ML.TorchLaunch(ML.kernel_module(fn, *structs), device)
    own_q = hq_pad != hq or np.dtype(st.ops.compute) != q_np
    q_buf = (torch.zeros((rows, hq_pad, d), dtype=dtypes.torch_dtype(st.ops.compute),
                         device=device) if own_q else None)
    partials = None
    if not st.finish:
      partials = tuple(torch.empty(shape, dtype=torch.float32, device=device)
                       for shape, _ in launch.module.outputs)
    return _Compiled(launch, st, hq_pad, q_buf, partials, None)

  def _entry(self, q, num_seqs, max_blocks, cache_shape) -> _Compiled:
    key = (tuple(q.shape), q.dtype, q.device, num_seqs, max_blocks, cache_shape)
    entry = self._compiled.get(key)
    if entry is None:
      entry = self._compiled[key] = self._compile(q, num_seqs, max_blocks, cache_shape)
    return entry

  # -- per-call inputs -----------------------------------------------------------------------
  def _factors(self, device, k_scale, v_scale):
    """float32 ``[H]``: softmax scale x K scale x log2(e), and the V scale, per KV head.
    Floats / None are kept per value; tensors (one scale, or one per KV head) cost a torch op
    each."""
    h = self.spec.num_kv_heads
    use = self.spec.format.has_tensor_scales
    base = self.scale * _LOG2E

    def one(name, s, mult):
      if not use or s is None or isinstance(s, (int, float)):
        value = mult * (float(s) if use and s is not None else 1.0)
        return self._const((name, device, value),
                           lambda: torch.full((h,), value, dtype=torch.float32, device=device))
      return (s.reshape(-1).to(torch.float32) * mult).expand(h).contiguous()
    return one("fac", k_scale, base), one("vfac", v_scale, 1.0)

  def _sink_columns(self, device, heads_padded):
    def make():
      x = np.full(heads_padded, -1e30, np.float32)
      x[:self.num_heads] = self.sinks * _LOG2E
      return torch.as_tensor(x, device=device)
    return self._const(("sinks", device, heads_padded), make)

  def _q_operand(self, entry: _Compiled, q):
    if entry.q_buf is None:
      return q.contiguous()
    src = q
    if entry.q_buf.dtype == torch.float16 and q.dtype != torch.float16:
      src = q.clamp(-_F16_MAX, _F16_MAX)     # saturate, as every GPU kernel's f16 operands
    entry.q_buf[:, :q.shape[1]].copy_(src)
    return entry.q_buf

  # -- the call ------------------------------------------------------------------------------
  def __call__(self, q, cache, query_start_loc, seq_lens, block_table, out, k_scale=None,
               v_scale=None, layer=None):
    """Attention of decode rows ``q`` ``[R, Hq, D]`` over ``cache``, into ``out``.

    cache: the physical torch tensor (storage dtype or uint8 for fp8): one layer's (4-D), or
    layered (5-D) with ``layer`` (a Python int) the layer attended over; query_start_loc
    int32 ``[S+1]`` (a sequence has at most one row), seq_lens int32 ``[S]``, block_table
    int32 ``[S, M]``, all contiguous on q's device; out ``[R, Hq, D]`` of q's dtype; k_scale,
    v_scale: None, floats or float32 tensors (fp8 caches). Returns ``out``.
    """
    if q.shape[0] == 0:
      return out
    num_seqs, max_blocks = block_table.shape
    entry = self._entry(q, num_seqs, max_blocks, tuple(cache.shape))
    st, device = entry.st, q.device
    cache = cache.view(dtypes.torch_dtype(self.spec.storage_dtype))   # uint8 fp8 -> fp8
    if st.ops.row_scaled:
      cache = cache.view(MD.cache_view_shape(cache.shape, st))
    qk = self._q_operand(entry, q)
    fac, vfac = self._factors(device, k_scale, v_scale)
    meta = (query_start_loc, seq_lens, block_table.view(-1))
    if st.finish:
      dst = out if out.is_contiguous() else self._out_buffer(entry, out)
      sinks = (self._sink_columns(device, entry.heads_padded),) if st.sinks else ()
      entry.launch.launch(*meta, fac, vfac, *sinks, qk, cache, *self._layer(device, layer), dst)
      if dst is not out:
        out.copy_(dst)
      return out
    acc, ml = entry.partials
    entry.launch.launch(*meta, fac, qk, cache, *self._layer(device, layer), acc, ml)
    self._merge(entry, acc, ml, vfac, out)
    return out

  def _layer(self, device, layer):
    """``()`` for one layer's cache, else the layer as an int32 ``[1]`` tensor (kept)."""
    if layer is None:
      return ()
    return (self._const(("layer", device, layer),
                        lambda: torch.tensor([layer], dtype=torch.int32, device=device)),)

  def _out_buffer(self, entry: _Compiled, out):
    if entry.out_buf is None:
      entry.out_buf = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    return entry.out_buf

  def _merge(self, entry: _Compiled, acc, ml, vfac, out):
    """Combine the split partials (:func:`pallas_kernels.common.merge_splits`'s formula, in
    the log2 domain) into ``out``: acc ``[R, H, P, D, 16]``, ml ``[R, H, P, 2, 16]``."""
    geo, h = entry.st.geo, self.spec.num_kv_heads
    g = geo.group
    device = acc.device
    cols = self._const(("cols", device, g, h), lambda: torch.as_tensor(
        [[geo.col_offset(i) + j for j in range(g)] for i in range(h)], device=device))
    pick = cols[None, :, None, None, :]
    acc = torch.take_along_dim(acc, pick, dim=-1)                        # [R, H, P, D, G]
    m = torch.take_along_dim(ml[:, :, :, 0], cols[None, :, None, :], dim=-1)   # [R, H, P, G]
    l = torch.take_along_dim(ml[:, :, :, 1], cols[None, :, None, :], dim=-1)
    m_max = m.amax(dim=2)                                                # [R, H, G]
    sink = None
    if self.sinks is not None:
      sink = self._const(("sink_hg", device), lambda: torch.as_tensor(
          self.sinks.reshape(h, g) * _LOG2E, device=device))
      m_max = torch.maximum(m_max, sink[None])
    w = torch.exp2(m - m_max[:, :, None])                                # [R, H, P, G]
    lsum = (w * l).sum(dim=2)                                            # [R, H, G]
    denom = lsum if sink is None else lsum + torch.exp2(sink[None] - m_max)
    o = (acc * w[:, :, :, None]).sum(dim=2)                              # [R, H, D, G]
    scale = torch.where(lsum > 0, vfac[None, :, None] / denom, 0.0)     # no key: 0
    o = o * scale[:, :, None]
    out.view(out.shape[0], h, g, -1).copy_(o.transpose(-1, -2))
