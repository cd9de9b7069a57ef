"""A vLLM-style attention backend over torch tensors, running kvjax's JAX ops.

``PagedAttentionBackend`` speaks vLLM's vocabulary (``get_kv_cache_shape``,
``get_kv_cache_stride_order``, ``do_kv_cache_update``, ``forward`` into a
preallocated ``output``) and runs ``kvjax.write_kv`` / ``kvjax.unified_attention``
(impl "auto": Pallas on GPU, the reference on CPU) on the *same* memory.

CUDA: the imported cache is donated to the jitted write, so the write lands in
torch's buffer in place (the pointer is checked on first use; if XLA ever did
not alias, the result is copied back and a warning raised). Stream ordering: see
:mod:`torch_bridge.interop` (one event per call torch -> JAX, a stream wait
JAX -> torch; the host never blocks).
CPU: JAX cannot donate an imported buffer (it would copy), so the new cache is
computed out of place and copied back into the torch tensor (a whole-cache copy per
update: fine for tests, not for serving); calls return after JAX has finished.

Compiled programs: one per (token count, sequence bucket, block-table width bucket,
query-length bucket) for ``forward`` and one per key row count for
``do_kv_cache_update`` (see :mod:`torch_bridge.jitted`): the metadata is padded with
zero-length sequences and unread block-table columns, the write's slots with -1.

Matmul precision: with a float32 model the JAX computation follows
``torch.get_float32_matmul_precision()`` at each call ("highest", torch's default:
true float32; "high": tensorfloat32; "medium": bfloat16), as torch's own float32
matmuls would; bfloat16 / float16 models keep JAX's setting. kvjax's JAX API itself
follows JAX's setting (``jax.default_matmul_precision`` / ``JAX_DEFAULT_MATMUL_PRECISION``).
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
from kvjax.spec import KVCacheSpec
from torch_bridge import checks
from torch_bridge import dlpack as D
from torch_bridge import dtypes
from torch_bridge import interop
from torch_bridge import jitted
from torch_bridge import layout as L
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
    impl: "auto" | "pallas" | "reference"; interpret: Pallas interpret mode (None = on CPU).
    crossing_mode: "fast" | "dlpack", see :mod:`torch_bridge.interop`.
    check_cuda_inputs: also check CUDA slot mappings, metadata and scale tensors on the
      host (kvjax's rules: slots < capacity, block ids in range, query_start_loc
      monotonic, ...). That copies them to the host, so the host waits for torch's
      queued work: a debugging aid, off by default. CPU inputs are always checked.
    output_mode: how ``forward`` fills ``output`` on CUDA: "donate" (default:
      ``output`` is imported and donated, XLA writes the result straight into it; a
      non-contiguous ``output`` falls back to copying) or "copy" (a device copy of JAX's
      result, ordered on torch's stream). Donation measured cheaper on the H200
      (benchmarks/results/facade.md). CPU always copies.
  """

  kv_cache_layout = "NHD"   # what get_kv_cache_stride_order uses when called on the class

  def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
               cache_dtype: str = "auto", layout: str = "NHD", dtype=torch.bfloat16,
               scale: Optional[float] = None, sliding_window: Optional[int] = None,
               soft_cap: Optional[float] = None, sinks=None, *, impl: str = "auto",
               interpret=None, crossing_mode: str = "fast", output_mode: str = "donate",
               check_cuda_inputs: bool = False):
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
    self._crossings = {}
    self._caches = {}        # cache tensor key -> storage-typed physical tensor
    self._inplace_checked = set()
    self._consts = {}        # (device, value) -> JAX scalar / sinks array
    self._attn = {}          # (max_query_len bucket, causal, donate, cuda) -> jitted fn
    self._write = {}         # cuda -> jitted fn

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
    buffer is 64-byte aligned so JAX imports it without a copy.
    """
    return D.empty_cache(self.spec, num_blocks, device=device, num_layers=num_layers)

  # -- helpers -------------------------------------------------------------------------------
  def _crossing(self, device) -> interop.Crossing:
    cx = self._crossings.get(device)
    if cx is None:
      cx = self._crossings[device] = interop.Crossing(device, self.crossing_mode)
    return cx

  def _cache(self, kv_cache) -> torch.Tensor:
    """The storage-typed physical tensor of ``kv_cache``: validated once per tensor identity
    (address, shape, strides, dtype); its storage's size checked every call (O(1))."""
    if isinstance(kv_cache, torch.Tensor):
      key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
      hit = self._caches.get(key)
      if hit is not None:
        phys, need = hit
        st = kv_cache.untyped_storage()
        if st.nbytes() < need or st.data_ptr() == 0:
          checks.check_storage(kv_cache, need=need)      # raises, naming the sizes
        return phys
      checks.check_storage(kv_cache)
    phys = L.physical_tensor(kv_cache, self.spec)
    if phys.ndim != 4:
      raise ValueError("pass one layer's 4-D cache (index the layers dim first)")
    phys = D.storage_typed(phys, self.spec)
    L.check_shareable(phys)
    if len(self._caches) >= 64:
      self._caches.clear()
    self._caches[key] = (phys, checks.storage_bytes_needed(kv_cache))
    return phys

  def _check_tokens(self, name, x, heads):
    if not isinstance(x, torch.Tensor):
      raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != self.dtype:
      raise TypeError(f"{name} dtype {x.dtype} is not the backend's dtype {self.dtype}")
    d = self.spec.head_size
    if x.ndim == 2 and x.shape[1] == heads * d:
      x = x.view(x.shape[0], heads, d)
    if x.ndim != 3 or tuple(x.shape[1:]) != (heads, d):
      raise ValueError(f"{name} must be [T, {heads}, {d}] (or [T, {heads * d}]), got "
                       f"{tuple(x.shape)}")
    return x

  def _impl(self, cx):
    """(impl, interpret) for tensors on ``cx``'s device. CPU tensors never take compiled
    Pallas, even on a machine whose default JAX backend is a GPU (JAX runs Pallas on the
    CPU only in interpret mode): "auto" is the reference there, interpret defaults on."""
    if cx.is_cuda:
      return self.impl, self.interpret
    return ("reference" if self.impl == "auto" else self.impl,
            True if self.interpret is None else self.interpret)

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

  def _copy_back(self, cx, phys, new):
    """CPU (or a CUDA write XLA did not alias): copy JAX's new cache into torch's buffer."""
    phys.view(torch.uint8).copy_(cx.to_torch(new).view(torch.uint8))

  # -- the two ops ---------------------------------------------------------------------------
  def do_kv_cache_update(self, key, value, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    """Write ``key``/``value`` ``[T', H, D]`` into ``kv_cache`` (torch, in place) by slot.

    ``slot_mapping``: int32/int64 ``[T]`` (negative = skip; int32 avoids a conversion).
    Quantizes on write for every cache dtype. Returns None (vLLM's convention).
    """
    h = self.spec.num_kv_heads
    key = self._check_tokens("key", key, h)
    value = self._check_tokens("value", value, h)
    phys = self._cache(kv_cache)
    cx = self._crossing(key.device)
    slots_t = self._slots(slot_mapping, phys.shape[0] * self.spec.block_size, key.shape[0])
    ks, vs = self._scales(cx, k_scale, v_scale)
    cx.fence()                 # after every torch op above, before every import below
    k, v = cx.fresh(key), cx.fresh(value)
    slots = cx.view(slots_t, zero_copy=False) if slots_t is slot_mapping else cx.fresh(slots_t)
    cache = cx.view(phys)
    prec = self._precision()
    fn = self._write.get((cx.is_cuda, prec))
    if fn is None:
      fn = self._write[(cx.is_cuda, prec)] = jitted.write_fn(self.spec, *self._impl(cx),
                                                            cx.is_cuda, prec)
    new = fn(cache, k, v, slots, self._scale_array(cx, ks), self._scale_array(cx, vs))
    if not cx.is_cuda:
      self._copy_back(cx, phys, new)
      return None
    pkey = cx._key(phys)
    if pkey not in self._inplace_checked:
      if new.unsafe_buffer_pointer() != phys.data_ptr():
        warnings.warn("torch_bridge: XLA did not write the donated cache in place; copying back")
        cx.forget(phys)
        self._copy_back(cx, phys, new)
        return None
      self._inplace_checked.add(pkey)
    cx.keep(phys, new)     # the donated input is gone; the result is the same memory
    cx.publish(new)
    return None

  def forward(self, query, kv_cache, metadata: PagedAttentionMetadata, output, k_scale=None,
              v_scale=None):
    """Attention of ``query`` ``[T, Hq, D]`` over ``kv_cache``, written into ``output``.

    ``output``: torch ``[T, Hq, D]`` (or ``[T, Hq*D]``) of the backend's dtype; rows of
    padding tokens (past ``query_start_loc[-1]``) get 0. Returns ``output``.
    """
    if not isinstance(metadata, PagedAttentionMetadata):
      raise TypeError(f"metadata must be a PagedAttentionMetadata, got {type(metadata).__name__}")
    q = self._check_tokens("query", query, self.num_heads)
    out = self._check_tokens("output", output, self.num_heads)
    if out.shape[0] != q.shape[0]:
      raise ValueError(f"output has {out.shape[0]} tokens, query {q.shape[0]}")
    phys = self._cache(kv_cache)
    cx = self._crossing(q.device)
    t = q.shape[0]
    metadata.check_values(t, phys.shape[0], self.spec.block_size, self.check_cuda_inputs)
    mql = metadata.padded(t)[3]          # torch work (padding), once per metadata and T
    if not q.is_contiguous():
      q = q.contiguous()
    ks, vs = self._scales(cx, k_scale, v_scale)
    cx.fence()                           # after every torch op above, before every import
    qj = cx.fresh(q)
    qsl, sl, bt = metadata.jax_arrays(cx, t)
    donate = cx.is_cuda and self.output_mode == "donate" and out.is_contiguous()
    prec = self._precision()
    fkey = (mql, metadata.causal, donate, cx.is_cuda, prec)
    fn = self._attn.get(fkey)
    if fn is None:
      fn = self._attn[fkey] = jitted.attention_fn(
          self.spec, self.scale, metadata.causal, self.sliding_window, self.soft_cap, mql,
          *self._impl(cx), donate, prec)
    args = (qj, cx.view(phys), qsl, sl, bt, self._sinks(cx), self._scale_array(cx, ks),
            self._scale_array(cx, vs))
    if not donate:
      out.copy_(cx.to_torch(fn(*args)))
      return output
    res = fn(*args, cx.fresh(out))
    if not self._out_checked:
      if res.unsafe_buffer_pointer() != out.data_ptr():
        warnings.warn("torch_bridge: XLA did not write into the donated output; copying")
        self.output_mode = "copy"
        out.copy_(cx.to_torch(res))
        return output
      self._out_checked = True
    cx.publish(res)
    return output

  def clear_cached_views(self):
    """Forget every imported view (releases the torch memory they keep alive)."""
    for cx in self._crossings.values():
      cx.clear()
    self._caches.clear()
