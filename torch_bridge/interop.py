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
import functools
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


@functools.lru_cache(maxsize=None)
def _jaxlib_entry_points():
  """(raw import, raw export): jaxlib's ``dlpack_managed_tensor_to_buffer`` as
  ``f(capsule, device, stream, copy, dl_type)`` whatever this jaxlib's signature, and
  ``buffer_to_dlpack_managed_tensor`` (private API: callers check them on first use)."""
  from jax._src.lib import _jax, jaxlib_extension_version
  to_buffer = _jax.dlpack_managed_tensor_to_buffer
  if jaxlib_extension_version < 467:
    old = to_buffer
    to_buffer = lambda capsule, device, stream, copy, dl_type: old(capsule, device, stream, copy)
  return to_buffer, _jax.buffer_to_dlpack_managed_tensor


def _raw_import(capsule, device, stream, copy, dl_type):
  """``dlpack_managed_tensor_to_buffer`` across jaxlib versions (private API)."""
  return _jaxlib_entry_points()[0](capsule, device, stream, copy, dl_type)


def _torch_capsule(t: torch.Tensor):
  """A DLPack capsule of ``t`` with no stream synchronization: what ``t.__dlpack__(stream=-1)``
  returns, without its Python checks that the callers make themselves (a tensor requiring
  grad is detached before; the CUDA current-device check is moot, the import names its
  device) except the conjugate bit's, which DLPack cannot carry."""
  if t.is_conj():
    raise BufferError("Can't export tensors with the conjugate bit set")
  return torch.utils.dlpack.to_dlpack(t)


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
    self._export_checked = False    # True: jaxlib's raw export works; None: use __dlpack__
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
    """CUDA, mode "fast": JAX's external-ready stream waits for torch's current stream.

    Returns torch's current stream (CUDA; None on CPU), for :meth:`publish` and
    :meth:`to_torch` of the same call (which run on the same stream)."""
    if not self.is_cuda:
      return None
    stream = torch.cuda.current_stream(self.device.index)   # an int: no device parsing
    if self.mode == "fast":
      self._event.record(stream)
      self._ext.wait_event(self._event)
    return stream

  def _fall_back(self, err):
    warnings.warn(f"torch_bridge: fast DLPack crossing unavailable ({type(err).__name__}: "
                  f"{err}); using jax.dlpack.from_dlpack per tensor")
    self.mode = "dlpack"

  def _import(self, t: torch.Tensor, copy) -> jax.Array:
    if self.mode == "fast":
      if self._fast_checked:
        return _raw_import(_torch_capsule(t), self.jax_device, self._jax_stream, copy,
                           self._dl_type)
      try:   # first use: the private entry point must work and share the pointer
        arr = _raw_import(_torch_capsule(t), self.jax_device, self._jax_stream, copy,
                          self._dl_type)
        if arr.dtype != t_dtype_np(t) or (copy is False and
                                          arr.unsafe_buffer_pointer() != t.data_ptr()):
          raise RuntimeError("raw import gave a different dtype or pointer")
        self._fast_checked = True
        return arr
      except Exception as e:  # noqa: BLE001 - a jaxlib whose private API differs
        self._fall_back(e)
    return jax.dlpack.from_dlpack(t, copy=copy)

  def stage(self, t: torch.Tensor) -> torch.Tensor:
    """A per-call input made ready for :meth:`input` / :meth:`fresh`; call it before
    :meth:`fence`. CUDA: made contiguous now (the copy is torch work, which the fence then
    orders the import after); CPU: ``t`` as it is (the import copies what it must)."""
    if self.is_cuda and not t.is_contiguous():
      return t.contiguous()
    return t

  def fresh(self, t: torch.Tensor) -> jax.Array:
    """Import a per-call input (query, key, value); made contiguous first if it is not.

    Call :meth:`fence` once per call before the first fresh import. A contiguous copy made
    here on CUDA is torch work queued after that fence, so it fences again (one more event;
    :meth:`stage` before the fence avoids it). May copy on CPU when the address is
    misaligned (inputs only, never the cache).
    """
    if t.device != self.device:
      raise ValueError(f"tensor on {t.device}, expected {self.device}")
    if t.requires_grad:
      t = t.detach()
    if not t.is_contiguous():
      t = t.contiguous()
      if self.is_cuda:
        self.fence()
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
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)   # torch.Size hashes as a tuple

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
  def _stream_pointer(self, stream):
    """The DLPack consumer stream of torch's ``stream`` (its current one if None): the
    stream's handle, 1 for CUDA's legacy default stream (handle 0)."""
    if stream is None:
      stream = torch.cuda.current_stream(self.device.index)
    s = stream.cuda_stream
    return s if s != 0 else 1

  def _export(self, arr: jax.Array, consumer):
    """A DLPack capsule of ``arr`` for the consumer stream ``consumer`` (None on CPU; on
    CUDA the stream is made to wait for ``arr``). Mode "fast": jaxlib's raw export, which
    ``arr.__dlpack__`` ends in after its Python checks (one device: the facade's results
    are), falling back to ``arr.__dlpack__`` for good if it fails on first use; mode
    "dlpack": ``arr.__dlpack__``."""
    if self._export_checked:
      return _jaxlib_entry_points()[1](arr, stream=consumer)
    if self._export_checked is False and self.mode == "fast":
      try:
        capsule = _jaxlib_entry_points()[1](arr, stream=consumer)
        self._export_checked = True
        return capsule
      except Exception:  # noqa: BLE001 - a jaxlib whose private API differs
        self._export_checked = None
    return arr.__dlpack__(stream=consumer)

  def publish(self, arr: jax.Array, stream=None):
    """Make torch's later work see ``arr``: a stream wait on CUDA (on ``stream``, the one
    :meth:`fence` returned, else torch's current stream), a host wait on CPU."""
    if self.is_cuda and self._publish_checked is not None:
      try:
        self._export(arr, self._stream_pointer(stream))
        self._publish_checked = True
        return
      except Exception as e:  # noqa: BLE001
        if self._publish_checked:
          raise
        warnings.warn(f"torch_bridge: stream-ordered export failed ({e}); blocking the host "
                      "on JAX results instead")
        self._publish_checked = None
    arr.block_until_ready()

  def to_torch(self, arr: jax.Array, stream=None) -> torch.Tensor:
    """A torch tensor sharing ``arr`` that torch's ``stream`` (the one :meth:`fence`
    returned, else its current one) may read now; on CPU after a host wait."""
    if not self.is_cuda:
      arr.block_until_ready()
      return torch.utils.dlpack.from_dlpack(self._export(arr, None))
    return torch.utils.dlpack.from_dlpack(self._export(arr, self._stream_pointer(stream)))
