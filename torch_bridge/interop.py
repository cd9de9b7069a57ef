"""The facade's hot path across the bridge: imports, long-lived views, stream ordering.

Per call the facade imports its fresh inputs (query, key, value), reuses cached
JAX views of long-lived tensors (the KV cache, scales, a step's metadata), runs a
jitted JAX function, and hands results back to torch. Ordering on CUDA:

- torch -> JAX: :meth:`Crossing.fence` records one event on torch's current
  stream and makes JAX's external-ready stream wait on it; every fresh import is
  then defined on that stream, so the jitted computation (which waits on all its
  inputs) sees all torch work queued before the call, including writes into the
  cached views. One event per call instead of one per tensor (``mode="fast"``);
  ``mode="dlpack"`` uses ``jax.dlpack.from_dlpack`` per tensor (same ordering,
  torch syncs the streams for each tensor).
- JAX -> torch: :meth:`Crossing.publish` exports the result with torch's current
  stream as the consumer, which enqueues a wait for the result on that stream
  (no host block); results copied with ``torch.from_dlpack`` get the same wait.
On CPU there are no streams: JAX results are waited for (``block_until_ready``)
before torch reads them, and donation is not used (JAX would copy an imported
buffer), so written caches are copied back into torch's memory.
"""
from __future__ import annotations

import collections
import warnings

import jax
import torch

from torch_bridge import dlpack as D
from torch_bridge import dtypes
from torch_bridge import layout as L

_DL_CPU, _DL_CUDA = 1, 2
MODES = ("fast", "dlpack")
#: Per-call CPU inputs at most this large are kept by identity (:meth:`Crossing.input`): a
#: kept view holds its tensor's memory, so the set stays small.
KEEP_INPUT_BYTES = 1 << 20


def t_dtype_np(t: torch.Tensor):
  return dtypes.numpy_dtype(t.dtype)


def _raw_import(capsule, device, stream, copy, dl_type):
  """``dlpack_managed_tensor_to_buffer`` across jaxlib versions (private API)."""
  from jax._src.lib import _jax, jaxlib_extension_version
  if jaxlib_extension_version >= 467:
    return _jax.dlpack_managed_tensor_to_buffer(capsule, device, stream, copy, dl_type)
  return _jax.dlpack_managed_tensor_to_buffer(capsule, device, stream, copy)


class Crossing:
  """torch <-> JAX crossings for one torch device.

  Args:
    device: the torch device of the tensors (cpu or cuda:i).
    mode: "fast" (one stream fence per call + raw DLPack imports) or "dlpack"
      (``jax.dlpack.from_dlpack`` per tensor). "fast" falls back to "dlpack" with a
      warning if this jaxlib's private import entry point does not work.
    max_views: how many long-lived views to keep (least recently used dropped).
      A kept view keeps its torch memory alive (it holds the DLPack capsule).
      (Caches are kept by the backend itself, not here.)
  """

  def __init__(self, device, mode: str = "fast", max_views: int = 64):
    if mode not in MODES:
      raise ValueError(f"mode={mode!r} must be one of {MODES}")
    self.device = torch.device(device)
    self.is_cuda = self.device.type == "cuda"
    if self.is_cuda and self.device.index is None:
      self.device = torch.device("cuda", torch.cuda.current_device())
    probe = torch.empty(0, device=self.device)
    self.jax_device = D.jax_device_of(probe)
    self.mode = mode
    self.max_views = max_views
    self._views = collections.OrderedDict()
    self._dl_type = _DL_CUDA if self.is_cuda else _DL_CPU
    self._jax_stream = None
    self._fast_checked = False
    self._publish_checked = False
    if self.is_cuda and mode == "fast":
      try:
        self._jax_stream = self.jax_device.get_stream_for_external_ready_events()
        self._ext = torch.cuda.ExternalStream(self._jax_stream, device=self.device)
        self._event = torch.cuda.Event()
      except Exception as e:  # noqa: BLE001 - any failure: the public per-tensor path
        self._fall_back(e)

  # -- torch -> JAX ------------------------------------------------------------------------
  def fence(self):
    """CUDA, mode "fast": JAX's external-ready stream waits for torch's current stream."""
    if self.is_cuda and self.mode == "fast":
      self._event.record(torch.cuda.current_stream(self.device))
      self._ext.wait_event(self._event)

  def _fall_back(self, err):
    warnings.warn(f"torch_bridge: fast DLPack crossing unavailable ({type(err).__name__}: "
                  f"{err}); using jax.dlpack.from_dlpack per tensor")
    self.mode = "dlpack"

  def _import(self, t: torch.Tensor, copy) -> jax.Array:
    if self.mode == "fast":
      if self._fast_checked:
        return _raw_import(t.__dlpack__(stream=-1), self.jax_device, self._jax_stream, copy,
                           self._dl_type)
      try:   # first use: the private entry point must work and share the pointer
        arr = _raw_import(t.__dlpack__(stream=-1), self.jax_device, self._jax_stream, copy,
                          self._dl_type)
        if arr.dtype != t_dtype_np(t) or (copy is False and
                                          arr.unsafe_buffer_pointer() != t.data_ptr()):
          raise RuntimeError("raw import gave a different dtype or pointer")
        self._fast_checked = True
        return arr
      except Exception as e:  # noqa: BLE001 - a jaxlib whose private API differs
        self._fall_back(e)
    return jax.dlpack.from_dlpack(t, copy=copy)

  def fresh(self, t: torch.Tensor) -> jax.Array:
    """Import a per-call input (query, key, value); made contiguous first if it is not.

    Call :meth:`fence` once per call before the first fresh import. May copy on
    CPU when the address is misaligned (inputs only, never the cache).
    """
    if t.device != self.device:
      raise ValueError(f"tensor on {t.device}, expected {self.device}")
    if t.requires_grad:
      t = t.detach()
    if not t.is_contiguous():
      t = t.contiguous()
    return self._import(t, None)

  def input(self, t: torch.Tensor) -> jax.Array:
    """A per-call input (query, key, value) after :meth:`fence`.

    CUDA: always a fresh import, defined after the fence, so the computation that reads it
    waits for torch's queued work (one such import per call orders the whole call). CPU,
    where the facade waits for each call's results before returning: a contiguous aligned
    tensor of at most ``KEEP_INPUT_BYTES`` is kept by identity like a long-lived view
    (passed again, it is not imported again; it aliases torch's memory, so in-place writes
    are seen), anything else is imported fresh.
    """
    if self.is_cuda or t.numel() * t.element_size() > KEEP_INPUT_BYTES or \
        not t.is_contiguous() or t.device != self.device:
      return self.fresh(t)
    return self.view(t, zero_copy=False)

  @staticmethod
  def _key(t: torch.Tensor):
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)

  def view(self, t: torch.Tensor, *, zero_copy: bool = True, keep: bool = True) -> jax.Array:
    """A JAX view of a long-lived contiguous tensor, imported once and reused.

    Keyed by (address, shape, strides, dtype): a cached array addresses exactly the
    tensor's memory, so torch's later in-place writes are seen by later calls (no version
    counter in the key: a view never goes stale, and torch writes through raw pointers do
    not count versions). ``zero_copy``: refuse (ValueError) instead of copying. Inputs that
    JAX would copy (misaligned CPU) are imported but not kept. ``keep=False``: import
    without keeping (for a caller that keeps the view itself).
    """
    key = self._key(t)
    arr = self._views.get(key) if keep else None
    if arr is not None and not arr.is_deleted():
      self._views.move_to_end(key)
      return arr
    if t.device != self.device:
      raise ValueError(f"tensor on {t.device}, expected {self.device}")
    if not t.is_contiguous():
      raise ValueError(f"tensor of shape {tuple(t.shape)} strides {t.stride()} is not "
                       "contiguous: it cannot be shared with JAX as is")
    if zero_copy:
      L.check_shareable(t)
    if t.requires_grad:
      t = t.detach()
    arr = self._import(t, False if zero_copy else None)
    if keep and (zero_copy or arr.unsafe_buffer_pointer() == t.data_ptr()):   # not a copy
      self.keep(t, arr)
    return arr

  def keep(self, t: torch.Tensor, arr: jax.Array):
    """Remember ``arr`` as the view of ``t`` (e.g. the aliased result of a donation)."""
    self._views[self._key(t)] = arr
    self._views.move_to_end(self._key(t))
    while len(self._views) > self.max_views:
      self._views.popitem(last=False)

  def forget(self, t: torch.Tensor):
    self._views.pop(self._key(t), None)

  def clear(self):
    """Drop every kept view (releases the torch memory they hold)."""
    self._views.clear()

  # -- JAX -> torch ------------------------------------------------------------------------
  def publish(self, arr: jax.Array):
    """Make torch's later work see ``arr``: a stream wait on CUDA, a host wait on CPU."""
    if self.is_cuda and self._publish_checked is not None:
      s = torch.cuda.current_stream(self.device).cuda_stream
      try:
        arr.__dlpack__(stream=s if s != 0 else 1)   # 1 = CUDA's legacy default stream
        self._publish_checked = True
        return
      except Exception as e:  # noqa: BLE001
        if self._publish_checked:
          raise
        warnings.warn(f"torch_bridge: stream-ordered export failed ({e}); blocking the host "
                      "on JAX results instead")
        self._publish_checked = None
    arr.block_until_ready()

  def to_torch(self, arr: jax.Array) -> torch.Tensor:
    """A torch tensor sharing ``arr`` that torch's current stream may read now."""
    if not self.is_cuda:
      arr.block_until_ready()
    return torch.from_dlpack(arr)
