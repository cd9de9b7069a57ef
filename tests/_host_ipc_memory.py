"""A stand-in for CUDA IPC memory on CPU: host buffers of this process, for the protocol tests.

Handles name buffers by address, so two :class:`~kvjax.transfer.ipc_transport.IpcServer` of one
process sharing one :class:`HostMemory` exercise the whole offer/pull protocol; it records every
fill and view address (what the tests check reuse and deferred frees with).
"""
import ctypes

import jax
import numpy as np


class HostMemory:
  def __init__(self):
    self.buffers = {}     # address -> its ctypes buffer
    self.fills, self.views, self.opened, self.closed = [], [], [], []

  def alloc(self, device, nbytes):
    del device
    buf = ctypes.create_string_buffer(int(nbytes))
    self.buffers[ctypes.addressof(buf)] = buf
    return ctypes.addressof(buf)

  def free(self, device, ptr):
    del device
    del self.buffers[ptr]

  def fill(self, device, ptr, array):
    del device
    data = np.asarray(jax.device_get(array)).tobytes()
    ctypes.memmove(ptr, data, len(data))
    self.fills.append(ptr)

  def handle(self, device, ptr):
    del device
    return int(ptr).to_bytes(8, "little") + bytes(56)

  def open(self, device, handle):
    del device
    ptr = int.from_bytes(handle[:8], "little")
    assert ptr in self.buffers, "a handle of no live buffer"
    self.opened.append(ptr)
    return ptr

  def close(self, device, ptr):
    del device
    self.closed.append(ptr)

  def view(self, ptr, shape, device):
    self.views.append(ptr)
    n = int(np.prod(shape))
    host = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr)).reshape(shape)
    return jax.device_put(host.copy(), device)
