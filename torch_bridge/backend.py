"""A vLLM-style attention backend over torch tensors, running kvjax's ops on the same memory.

``PagedAttentionBackend`` speaks vLLM's vocabulary (``get_kv_cache_shape``,
``get_kv_cache_stride_order``, ``do_kv_cache_update``, ``forward`` into a preallocated
``output``). Two paths (docs/pytorch.md):

* Kernels launched on torch's stream (:mod:`torch_bridge.launches`): on a Hopper GPU, decode
  attention and writes of the formats the Mosaic GPU kernels read; no JAX dispatch.
* JAX (every other call): ``kvjax.write_kv`` / ``kvjax.unified_attention`` under cached
  ``jax.jit`` functions (:mod:`torch_bridge.jitted`: one program per padded shape bucket).
  CUDA: the imported cache is donated, so the write lands in torch's buffer in place (checked
  on first use; if XLA did not alias, the result is copied back with a warning); one event
  orders JAX after torch's stream and torch's stream waits on JAX's result
  (:mod:`torch_bridge.interop`; the host never blocks). CPU: JAX cannot donate an imported
  buffer, so the new cache is computed out of place and the written pages are copied back.
  Long-lived tensors (cache, metadata, int32 slots, the donated output) are checked and
  imported once, kept by identity (:mod:`torch_bridge.kept`).

Layered (cross-layer) caches (``allocate_kv_cache(num_blocks, num_layers=L)``) are passed
whole with ``layer=l``: the layer is a traced int32, so every layer shares one program. A
layer's slice ``kv[l]`` or one block ``kv[:, b]`` is refused.

Matmul precision: a float32 model follows ``torch.get_float32_matmul_precision()`` at each
call ("highest": float32, "high": tensorfloat32, "medium": bfloat16); 16-bit models keep
JAX's setting.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

import kvjax
from kvjax.registry import AttentionCall
from kvjax.spec import KVCacheSpec
from torch_bridge import checks
from torch_bridge import dlpack as D
from torch_bridge import dtypes
from torch_bridge import interop
from torch_bridge import jitted
from torch_bridge import layout as L
from torch_bridge.kept import (KEEP_CACHES, KEEP_OUTPUT_BYTES, KEEP_OUTPUTS, KeptCache,
                               check_layer, copy_pages_back)
from torch_bridge.launches import WRITE_PATH, LastPath, TorchLaunches
from torch_bridge.metadata import PagedAttentionMetadata


class _layout_method:
  """Callable on the class (default layout) or on an instance (its own layout)."""

  def __init__(self, fn):
    self.fn = fn
    functools.update_wrapper(self, fn)

  def __get__(self, obj, cls):
    layout = cls.kv_cache_layout if obj is None else obj.spec.layout
    return functools.partial(self.fn, layout)


class PagedAttentionBackend:
  """Paged attention on a packed torch KV cache, computed by kvjax in JAX.

  Args:
    num_heads: Hq, query heads. num_kv_heads: H. head_size: D. block_size: N.
    cache_dtype: a kvjax cache dtype ("auto", "fp8", "int8_per_token_head", "nvfp4", ...).
    layout: "NHD" or "HND" (nvfp4 needs "HND").
    dtype: torch model dtype of query / key / value / output.
    scale: softmax scale (default D**-0.5). sliding_window, soft_cap: as in vLLM.
    sinks: float ``[Hq]`` per-query-head sink logits (torch tensor or array) or None.
    impl: "auto" | "pallas" | "reference"; interpret: Pallas interpret mode (None: on CPU
      tensors with impl="pallas").
    crossing_mode: "fast" | "dlpack", see :mod:`torch_bridge.interop`.
    check_cuda_inputs: also check CUDA slot mappings, metadata and scale tensors on the
      host (kvjax's rules: slots < capacity, block ids in range, query_start_loc
      monotonic, ...). That copies them to the host, so the host waits for torch's
      queued work: a debugging aid, off by default. CPU inputs are always checked.
    output_mode: how ``forward`` fills ``output`` on CUDA: "donate" (default:
      ``output`` is imported and donated, XLA writes the result straight into it; a
      non-contiguous ``output`` falls back to copying) or "copy" (a device copy of JAX's
      result, ordered on torch's stream). Donation is the cheaper of the two
      (benchmarks/RESULTS.md, "Torch facade"). CPU always copies.
    direct_launch: on a Hopper GPU, launch kvjax's Mosaic GPU kernels on torch's current
      stream for the decode steps, long prefills and writes they read (which:
      :mod:`torch_bridge.launches`; no JAX dispatch, capturable in CUDA graphs); False:
      every call goes through JAX. :attr:`last_path` / :attr:`last_write_path` say which
      path the last call took, :meth:`direct_reason` / :meth:`direct_write_reason` why a
      call would not take the launch.
  """
  #: The path of the last ``forward`` / ``do_kv_cache_update``: "mosaic_gpu decode (write)
  #: launched from torch" or "jax (<implementation>): <why not the launch>".
  last_path, last_write_path = LastPath(), LastPath()

  kv_cache_layout = "NHD"   # what get_kv_cache_stride_order uses when called on the class

  def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
               cache_dtype: str = "auto", layout: str = "NHD", dtype=torch.bfloat16,
               scale: Optional[float] = None, sliding_window: Optional[int] = None,
               soft_cap: Optional[float] = None, sinks=None, *, impl: str = "auto",
               interpret=None, crossing_mode: str = "fast", output_mode: str = "donate",
               check_cuda_inputs: bool = False, direct_launch: bool = True):
    self.spec = KVCacheSpec(num_kv_heads, head_size, block_size, cache_dtype, layout,
                            dtypes.numpy_dtype(dtype))
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0 \
        or num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads!r} must be a positive multiple of "
                       f"num_kv_heads={num_kv_heads}")
    if crossing_mode not in interop.MODES:
      raise ValueError(f"crossing_mode={crossing_mode!r} must be one of {interop.MODES}")
    if output_mode not in ("copy", "donate"):
      raise ValueError(f"output_mode={output_mode!r} must be 'copy' or 'donate'")
    kvjax.validation.check_impl(impl)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
      raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    kvjax.validation.check_soft_cap(soft_cap)
    self.num_heads = num_heads
    self.dtype = dtypes.torch_dtype(self.spec.dtype)
    if scale is not None:
      kvjax.validation.check_softmax_scale(scale)
    self.scale = float(head_size ** -0.5 if scale is None else scale)
    self.sliding_window = sliding_window
    self.soft_cap = None if soft_cap is None else float(soft_cap)
    self.sinks = None
    if sinks is not None:
      s = np.asarray(sinks.detach().float().cpu() if isinstance(sinks, torch.Tensor) else sinks,
                     np.float32)
      if s.shape != (num_heads,):
        raise ValueError(f"sinks must have shape [{num_heads}], got {s.shape}")
      self.sinks = s
    self.impl, self.interpret, self.crossing_mode = impl, interpret, crossing_mode
    self.output_mode = output_mode
    self.check_cuda_inputs = bool(check_cuda_inputs)
    self._out_checked = False
    self._tensor_scales = self.spec.format.has_tensor_scales
    self._token_shape = {}   # heads -> (heads, D)
    self._crossings = {}
    self._caches = {}        # cache tensor key -> KeptCache
    self._outs = {}          # output tensor key -> the donated result aliasing it (CUDA)
    self._consts = {}        # (device, value) -> JAX scalar / sinks array
    self._attn = {}          # (max_query_len bucket, causal, donate, cuda, precision) -> fn
    self._write = {}         # (cuda, precision) -> jitted fn
    self._launches = TorchLaunches(self.spec, num_heads, self.dtype, self.scale,
                                   sliding_window, self.soft_cap, self.sinks,
                                   bool(direct_launch), impl)
    self.last_path = self.last_write_path = None

  # -- vLLM's static layout API --------------------------------------------------------------
  @staticmethod
  def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                         cache_dtype: str = "auto"):
    """vLLM's logical cache shape ``(B, H, N, C)`` (``(B, 2H, N, D/2 + D/16)`` for nvfp4)."""
    return kvjax.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype)

  @_layout_method
  def get_kv_cache_stride_order(layout, include_num_layers_dimension: bool = False):
    """Logical dim stored at each physical position; the instance's layout (class: NHD)."""
    return kvjax.get_kv_cache_stride_order(layout, include_num_layers_dimension)

  # -- allocation ----------------------------------------------------------------------------
  def allocate_kv_cache(self, num_blocks: int, device="cpu", num_layers: Optional[int] = None):
    """A zeroed torch cache: logical shape, the layout's stride order, importable zero-copy.

    dtype: the storage dtype (uint8 for fp8 per-tensor caches, as vLLM). On CPU the
    buffer is 64-byte aligned so JAX imports it without a copy. With ``num_layers`` one
    layered (cross-layer) cache, logical ``(L, B, H, N, C)``: pass it whole with ``layer=``.
    """
    return D.empty_cache(self.spec, num_blocks, device=device, num_layers=num_layers)

  # -- helpers -------------------------------------------------------------------------------
  def _crossing(self, device) -> interop.Crossing:
    cx = self._crossings.get(device)
    if cx is None:
      cx = self._crossings[device] = interop.Crossing(device, self.crossing_mode)
    return cx

  def _cache(self, kv_cache, layer) -> "KeptCache":
    """The cache entry of ``kv_cache``: validated once per tensor identity (address, shape,
    strides, dtype); its storage's size checked every call (O(1)), and ``layer`` against it.
    """
    if isinstance(kv_cache, torch.Tensor):
      key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
      entry = self._caches.get(key)
      if entry is not None and entry.phys.data_ptr() != key[0]:
        entry = None     # its storage moved (resized): a new tensor at the old address
      if entry is not None:
        st = kv_cache.untyped_storage()
        if st.nbytes() < entry.need or st.data_ptr() == 0:
          checks.check_storage(kv_cache, need=entry.need)   # raises, naming the sizes
        if (layer is None) != (entry.num_layers is None) or layer is not None and not (
            type(layer) is int and 0 <= layer < entry.num_layers):
          check_layer(layer, entry.num_layers, kv_cache)     # raises
        return entry
      checks.check_storage(kv_cache)
    phys = L.physical_tensor(kv_cache, self.spec)
    if phys.ndim == 4:
      L.refuse_part_of_storage(phys)
    phys = D.storage_typed(phys, self.spec)
    L.check_shareable(phys)
    entry = KeptCache(phys, checks.storage_bytes_needed(kv_cache), phys.shape[0],
                   phys.shape[self.spec.layer_axis] if phys.ndim == 5 else None)
    check_layer(layer, entry.num_layers, kv_cache)
    if len(self._caches) >= KEEP_CACHES:
      self._caches.pop(next(iter(self._caches)))      # the oldest: a cache no longer in use
    self._caches[key] = entry
    return entry

  def _cache_array(self, cx, entry: "KeptCache") -> jax.Array:
    """The JAX view of the cache (kept in its entry; after a donated write, the result)."""
    arr = entry.arr
    if arr is None or arr.is_deleted():
      arr = entry.arr = cx.view(entry.phys, keep=False)
    return arr

  def _layer_array(self, cx, layer):
    """None, or the layer index as an int32 JAX scalar on ``cx``'s device (kept per value):
    a traced argument of the jitted functions, so every layer shares one program."""
    if layer is None:
      return None
    key = (cx.device, "layer", layer)
    arr = self._consts.get(key)
    if arr is None:
      arr = self._consts[key] = jax.device_put(jnp.asarray(layer, jnp.int32), cx.jax_device)
    return arr

  def _check_tokens(self, name, x, heads):
    if not isinstance(x, torch.Tensor):
      raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != self.dtype:
      raise TypeError(f"{name} dtype {x.dtype} is not the backend's dtype {self.dtype}")
    want = self._token_shape.get(heads)
    if want is None:
      want = self._token_shape[heads] = (heads, self.spec.head_size)
    shape = x.shape
    if len(shape) == 3 and shape[1:] == want:
      return x
    d = want[1]
    if len(shape) == 2 and shape[1] == heads * d:
      return x.view(shape[0], heads, d)
    raise ValueError(f"{name} must be [T, {heads}, {d}] (or [T, {heads * d}]), got "
                     f"{tuple(shape)}")

  def _impl(self, on_cuda: bool):
    """(impl, interpret) for CUDA or CPU tensors. On CPU "auto" lets the registry choose for
    the CPU (never a compiled GPU kernel), and Pallas named runs in interpret mode."""
    named_on_cpu = not on_cuda and self.impl != "auto" and self.interpret is None
    return self.impl, True if named_on_cpu else self.interpret

  def _precision(self):
    """The matmul precision the jitted functions are traced with: for a float32 model,
    torch's ``get_float32_matmul_precision()`` ("highest" -> true float32, "high" ->
    tensorfloat32, "medium" -> bfloat16); for other dtypes None (JAX's own setting)."""
    if self.dtype != torch.float32:
      return None
    return jitted.TORCH_TO_JAX_PRECISION[torch.get_float32_matmul_precision()]

  def _const(self, cx, value):
    key = (cx.device, value)
    arr = self._consts.get(key)
    if arr is None:
      arr = self._consts[key] = jax.device_put(jnp.asarray(value, jnp.float32), cx.jax_device)
    return arr

  def _scales(self, cx, k_scale, v_scale):
    """Checked global scales, as float32 tensors on ``cx``'s device or floats (torch work:
    call before the fence); None, None for formats without global scales (kvjax ignores
    them there too)."""
    if not self._tensor_scales:
      return None, None
    checks.check_scales(self.spec, k_scale, v_scale, self.check_cuda_inputs)
    return self._scale(cx, "k_scale", k_scale), self._scale(cx, "v_scale", v_scale)

  def _scale(self, cx, name, s):
    if s is None or isinstance(s, (int, float)):
      return s
    if isinstance(s, torch.Tensor):
      if s.dtype != torch.float32 or s.device != cx.device:
        s = s.to(device=cx.device, dtype=torch.float32)
      return s.contiguous()
    raise TypeError(f"{name} must be None, a float or a torch.Tensor, got {type(s).__name__}")

  def _scale_array(self, cx, s):
    """A scale from :meth:`_scales` as a JAX array (after the fence)."""
    if s is None:
      return None
    if isinstance(s, torch.Tensor):
      return cx.view(s, zero_copy=False)
    return self._const(cx, float(s))

  def _sinks(self, cx):
    if self.sinks is None:
      return None
    key = (cx.device, "sinks")
    arr = self._consts.get(key)
    if arr is None:
      arr = self._consts[key] = jax.device_put(jnp.asarray(self.sinks), cx.jax_device)
    return arr

  def _slots(self, slot_mapping, num_slots: int, num_rows: int) -> torch.Tensor:
    """int32 slots padded with -1 to ``num_rows`` (the key's rows): writes compile once per
    key row count, whatever the number of real tokens (vLLM passes the slots unpadded)."""
    if not isinstance(slot_mapping, torch.Tensor):
      raise TypeError(f"slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.ndim != 1:
      raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
      raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.shape[0] > num_rows:
      raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots but key has {num_rows} "
                       "tokens")
    return checks.slots_int32(slot_mapping, num_slots, self.check_cuda_inputs, num_rows)

  # -- the two ops ---------------------------------------------------------------------------
  def do_kv_cache_update(self, key, value, kv_cache, slot_mapping, k_scale=None, v_scale=None,
                         layer: Optional[int] = None):
    """Write ``key``/``value`` ``[T', H, D]`` into ``kv_cache`` (torch, in place) by slot.

    ``slot_mapping``: int32/int64 ``[T]`` (negative = skip; int32 avoids a conversion).
    ``layer``: with a layered cache (``allocate_kv_cache(..., num_layers=L)``), the layer
    written (a Python int; slots are the layer's own); None for one layer's cache.
    Quantizes on write for every cache dtype. Returns None (vLLM's convention).
    """
    h = self.spec.num_kv_heads
    key = self._check_tokens("key", key, h)
    value = self._check_tokens("value", value, h)
    entry = self._cache(kv_cache, layer)
    cx = self._crossing(key.device)
    key, value = cx.stage(key), cx.stage(value)   # CUDA: contiguous before the fence
    num_slots = entry.num_blocks * self.spec.block_size
    slots_t = self._slots(slot_mapping, num_slots, key.shape[0])
    ks, vs = self._scales(cx, k_scale, v_scale)
    launch = self._launches.write(key.device)
    if not isinstance(launch, str):
      launch(key, value, entry.phys, slots_t, ks, vs, layer)
      self.last_write_path = WRITE_PATH
      return None
    impl = self._impl(cx.is_cuda)
    self.last_write_path = (self.spec, "write", launch, *impl, cx.is_cuda)
    stream = cx.fence()        # after every torch op above, before every import below
    k, v = cx.input(key), cx.input(value)       # CUDA: fresh after the fence, carrying it
    slots = cx.view(slots_t, zero_copy=False) if slots_t is slot_mapping else cx.fresh(slots_t)
    cache = self._cache_array(cx, entry)
    prec = self._precision()
    fn = self._write.get((cx.is_cuda, prec))
    if fn is None:
      fn = self._write[(cx.is_cuda, prec)] = jitted.write_fn(self.spec, *impl, cx.is_cuda, prec)
    new = fn(cache, k, v, slots, self._scale_array(cx, ks), self._scale_array(cx, vs),
             self._layer_array(cx, layer))
    if not cx.is_cuda:
      host = slots_t.numpy()
      named = host[(host >= 0) & (host < num_slots)]
      new.block_until_ready()
      copy_pages_back(entry, new, np.unique(named // self.spec.block_size), layer,
                      self.spec.layer_axis)
      return None
    if not entry.inplace_checked:
      if new.unsafe_buffer_pointer() != entry.phys.data_ptr():
        warnings.warn("torch_bridge: XLA did not write the donated cache in place; copying back")
        entry.arr = None
        entry.phys.view(torch.uint8).copy_(cx.to_torch(new, stream).view(torch.uint8))
        return None
      entry.inplace_checked = True
    entry.arr = new        # the donated input is gone; the result is the same memory
    cx.publish(new, stream)
    return None

  def forward(self, query, kv_cache, metadata: PagedAttentionMetadata, output, k_scale=None,
              v_scale=None, layer: Optional[int] = None):
    """Attention of ``query`` ``[T, Hq, D]`` over ``kv_cache``, written into ``output``.

    ``output``: torch ``[T, Hq, D]`` (or ``[T, Hq*D]``) of the backend's dtype; rows of
    padding tokens (past ``query_start_loc[-1]``) get 0. ``layer``: with a layered cache,
    the layer attended over (a Python int); None for one layer's cache. Returns ``output``.
    """
    if not isinstance(metadata, PagedAttentionMetadata):
      raise TypeError(f"metadata must be a PagedAttentionMetadata, got {type(metadata).__name__}")
    q = self._check_tokens("query", query, self.num_heads)
    out = self._check_tokens("output", output, self.num_heads)
    t = q.shape[0]
    if out.shape[0] != t:
      raise ValueError(f"output has {out.shape[0]} tokens, query {t}")
    entry = self._cache(kv_cache, layer)
    cx = self._crossing(q.device)
    q = cx.stage(q)                      # CUDA: contiguous before the fence
    metadata.check_values(t, entry.num_blocks, self.spec.block_size, self.check_cuda_inputs)
    ks, vs = self._scales(cx, k_scale, v_scale)
    launch = self._launches.attention(q.device, metadata.max_query_len, layer is not None)
    if not isinstance(launch, str):   # the metadata as it is (int32, contiguous): no padding
      self.last_path = launch(q, entry.phys, metadata, out, ks, vs, layer)
      return output
    mql = metadata.padded(t)[3]          # torch work (padding), once per metadata and T
    stream = cx.fence()                  # after every torch op above, before every import
    qj = cx.input(q)                     # CUDA: a fresh import, carrying the fence
    qsl, sl, bt = metadata.jax_arrays(cx, t)
    call, impl = AttentionCall(t, self.num_heads, len(sl), bt.shape[1], mql), self._impl(cx.is_cuda)
    self.last_path = (self.spec, "attention", launch, *impl, cx.is_cuda, call, layer is not None)
    donate = cx.is_cuda and self.output_mode == "donate" and out.is_contiguous()
    prec = self._precision()
    fkey = (mql, metadata.causal, donate, cx.is_cuda, prec)
    fn = self._attn.get(fkey)
    if fn is None:
      fn = self._attn[fkey] = jitted.attention_fn(
          self.spec, self.scale, metadata.causal, self.sliding_window, self.soft_cap, mql,
          *impl, donate, prec)
    args = (qj, self._cache_array(cx, entry), qsl, sl, bt, self._sinks(cx),
            self._scale_array(cx, ks), self._scale_array(cx, vs), self._layer_array(cx, layer))
    if not donate:
      out.copy_(cx.to_torch(fn(*args), stream))
      return output
    # out is contiguous [t, Hq, D] of the backend's dtype (checked above): its address and t
    # name the memory a kept result aliases
    okey = (out.data_ptr(), t)
    prev = self._outs.pop(okey, None)    # the previous result in out's memory, if kept
    res = fn(*args, prev if prev is not None and not prev.is_deleted() else cx.fresh(out))
    if not self._out_checked:
      if res.unsafe_buffer_pointer() != out.data_ptr():
        warnings.warn("torch_bridge: XLA did not write into the donated output; copying")
        self.output_mode = "copy"
        out.copy_(cx.to_torch(res, stream))
        return output
      self._out_checked = True
    if out.numel() * out.element_size() <= KEEP_OUTPUT_BYTES:
      if len(self._outs) >= KEEP_OUTPUTS:
        self._outs.pop(next(iter(self._outs)))
      self._outs[okey] = res             # it keeps out's memory alive: a small bounded set
    cx.publish(res, stream)
    return output

  def direct_reason(self, device, metadata: PagedAttentionMetadata,
                    layered: bool = False) -> Optional[str]:
    """None when ``forward`` on ``device`` with ``metadata`` (over a layered cache)
    launches a Mosaic GPU kernel from torch, else why it goes through JAX."""
    got = self._launches.attention(device, metadata.max_query_len, layered)
    return got if isinstance(got, str) else None

  def direct_write_reason(self, device) -> Optional[str]:
    """None when ``do_kv_cache_update`` on ``device`` launches the Mosaic GPU row-store
    kernel from torch, else why it goes through JAX."""
    got = self._launches.write(device)
    return got if isinstance(got, str) else None

  def clear_cached_views(self):
    """Forget every imported view (releases the torch memory they keep alive)."""
    for cx in self._crossings.values():
      cx.clear()
    self._caches.clear()
    self._outs.clear()
