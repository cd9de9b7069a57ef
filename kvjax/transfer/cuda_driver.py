"""The few CUDA driver calls that share device memory between processes of one host.

Bound with :mod:`ctypes` to ``libcuda.so.1`` (the driver every CUDA process has loaded), so
the transfer path needs no CUDA Python package. Every call runs in the device's primary
context (the one JAX and torch use; pushed for the call, popped after), so the caller's thread
state is left as it was. Errors raise :class:`CudaDriverError` with the driver's name for the
code.

Memory that JAX allocates cannot be shared this way (its allocator maps memory without the
legacy IPC capability), so the exporting side copies what it shares into memory of
:func:`alloc`:
  exporter: ``ptr = alloc(dev, n)``; ``copy(dev, ptr, src, n)``; ``handle = ipc_handle(dev, ptr)``
  importer: ``mapped = open_ipc_handle(dev, handle)`` (the same bytes, read in place);
            ``close_ipc_handle(dev, mapped)`` when done.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Tuple

import jax
import jax.numpy as jnp

IPC_HANDLE_BYTES = 64
_CU_STREAM_NON_BLOCKING = 1
_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CudaDriverError(RuntimeError):
  """A CUDA driver call failed; ``code`` is the driver's CUresult."""

  def __init__(self, call: str, code: int, name: str):
    super().__init__(f"{call} failed: {name} ({code})")
    self.code = code


class _IpcHandle(ctypes.Structure):
  _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


@functools.lru_cache(maxsize=None)
def _lib():
  try:
    lib = ctypes.CDLL("libcuda.so.1")
  except OSError as e:
    raise RuntimeError("the CUDA driver (libcuda.so.1) is not available on this machine") from e
  _check(lib, "cuInit", lib.cuInit(0))
  return lib


def _check(lib, call: str, code: int) -> None:
  if code != 0:
    name = ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(name))
    raise CudaDriverError(call, code, (name.value or b"CUDA_ERROR_UNKNOWN").decode())


@functools.lru_cache(maxsize=None)
def _primary_context(ordinal: int) -> ctypes.c_void_p:
  """The device's primary context (the one JAX's and torch's runtimes use), retained once."""
  lib = _lib()
  dev, ctx = ctypes.c_int(), ctypes.c_void_p()
  _check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)))
  _check(lib, "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
  return ctx


class _OnDevice:
  """Run driver calls in device ``ordinal``'s primary context (pushed, then popped)."""

  def __init__(self, ordinal: int):
    self.lib = _lib()
    self.ctx = _primary_context(int(ordinal))

  def __enter__(self):
    _check(self.lib, "cuCtxPushCurrent", self.lib.cuCtxPushCurrent_v2(self.ctx))
    return self.lib

  def __exit__(self, *exc):
    popped = ctypes.c_void_p()
    self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped))


def alloc(ordinal: int, nbytes: int) -> int:
  """``nbytes`` of device memory on device ``ordinal`` that can be shared by IPC handle."""
  with _OnDevice(ordinal) as lib:
    ptr = ctypes.c_uint64()
    _check(lib, "cuMemAlloc", lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)))
  return int(ptr.value)


def free(ordinal: int, ptr: int) -> None:
  """Free memory of :func:`alloc`."""
  with _OnDevice(ordinal) as lib:
    _check(lib, "cuMemFree", lib.cuMemFree_v2(ctypes.c_uint64(ptr)))


@functools.lru_cache(maxsize=None)
def _copy_stream(ordinal: int) -> ctypes.c_void_p:
  with _OnDevice(ordinal) as lib:
    stream = ctypes.c_void_p()
    _check(lib, "cuStreamCreate", lib.cuStreamCreate(ctypes.byref(stream),
                                                     ctypes.c_uint(_CU_STREAM_NON_BLOCKING)))
  return stream


def copy(ordinal: int, dst: int, src: int, nbytes: int) -> None:
  """Copy ``nbytes`` device to device and wait until the copy is complete."""
  stream = _copy_stream(ordinal)
  with _OnDevice(ordinal) as lib:
    _check(lib, "cuMemcpyDtoDAsync", lib.cuMemcpyDtoDAsync_v2(
        ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes), stream))
    _check(lib, "cuStreamSynchronize", lib.cuStreamSynchronize(stream))


def ipc_handle(ordinal: int, ptr: int) -> bytes:
  """The 64-byte IPC handle of memory of :func:`alloc` (its start ``ptr``)."""
  with _OnDevice(ordinal) as lib:
    handle = _IpcHandle()
    _check(lib, "cuIpcGetMemHandle", lib.cuIpcGetMemHandle(ctypes.byref(handle),
                                                           ctypes.c_uint64(ptr)))
  return bytes(handle)   # all 64 bytes (the field's .value would stop at a zero byte)


def open_ipc_handle(ordinal: int, handle: bytes) -> int:
  """Map another process's memory (its :func:`ipc_handle`) on device ``ordinal``; returns the
  mapped start address."""
  if len(handle) != IPC_HANDLE_BYTES:
    raise ValueError(f"handle must be {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
  with _OnDevice(ordinal) as lib:
    mapped = ctypes.c_uint64()
    _check(lib, "cuIpcOpenMemHandle",
           lib.cuIpcOpenMemHandle_v2(ctypes.byref(mapped), _IpcHandle.from_buffer_copy(handle),
                                     ctypes.c_uint(_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)))
  return int(mapped.value)


def close_ipc_handle(ordinal: int, mapped: int) -> None:
  """Unmap memory mapped by :func:`open_ipc_handle`."""
  with _OnDevice(ordinal) as lib:
    _check(lib, "cuIpcCloseMemHandle", lib.cuIpcCloseMemHandle(ctypes.c_uint64(mapped)))


class CudaIpcMemory:
  """Shareable device memory through the CUDA driver; devices are JAX devices."""

  @staticmethod
  def _ordinal(device) -> int:
    if device.platform != "gpu":
      raise ValueError(f"the CUDA IPC transport needs arrays on a CUDA GPU, got {device}")
    return int(device.local_hardware_id)

  def alloc(self, device, nbytes: int) -> int:
    return alloc(self._ordinal(device), nbytes)

  def free(self, device, ptr: int) -> None:
    free(self._ordinal(device), ptr)

  def fill(self, device, ptr: int, array: jax.Array) -> None:
    """Copy a ready single-device ``array``'s bytes to ``ptr`` (complete on return)."""
    copy(self._ordinal(device), ptr, array.unsafe_buffer_pointer(), array.nbytes)

  def handle(self, device, ptr: int) -> bytes:
    return ipc_handle(self._ordinal(device), ptr)

  def open(self, device, handle: bytes) -> int:
    return open_ipc_handle(self._ordinal(device), handle)

  def close(self, device, mapped: int) -> None:
    close_ipc_handle(self._ordinal(device), mapped)

  #: :meth:`view` reads the memory in place: a view stays valid for reuse while mapped.
  views_alias = True

  def view(self, ptr: int, shape: Tuple[int, ...], device) -> jax.Array:
    """uint8 ``shape`` at ``ptr`` as a JAX array on ``device``, without a copy."""
    arr = jnp.asarray(_DeviceBytes(ptr, shape))
    if arr.devices() != {device}:   # mapped from another device of the host
      arr = jax.device_put(arr, device)
    return arr


class _DeviceBytes:
  """Device bytes described by the CUDA array interface (what ``jnp.asarray`` imports)."""

  def __init__(self, ptr: int, shape: Tuple[int, ...]):
    self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": "|u1",
                                     "data": (int(ptr), False), "strides": None, "version": 3}


__all__ = ["CudaDriverError", "IPC_HANDLE_BYTES", "alloc", "free", "copy", "ipc_handle",
           "open_ipc_handle", "close_ipc_handle", "CudaIpcMemory"]
