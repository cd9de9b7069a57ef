"""Which of a backend's calls launch kvjax's kernels from torch, per device, and why not.

:class:`TorchLaunches` keeps, per torch device, the launcher of each call
(:class:`torch_bridge.mosaic_decode.TorchDecode`, :class:`torch_bridge.mosaic_write.TorchWrite`)
or the reason there is none; a call asks it (host-only, O(1) after the first call per device)
and goes through JAX when the answer is a reason.
"""
from __future__ import annotations

from typing import Optional

import torch

#: What ``PagedAttentionBackend.last_path`` / ``last_write_path`` say of a launched call.
DECODE_PATH = "mosaic_gpu decode launched from torch"
WRITE_PATH = "mosaic_gpu write launched from torch"


class TorchLaunches:
  """The launchers of one backend configuration.

  enabled: the backend's ``direct_launch``; impl: its ``impl`` ("reference" launches
  nothing); the rest: the backend's spec and attention options.
  """

  def __init__(self, spec, num_heads: int, dtype, scale: float, sliding_window, soft_cap,
               sinks, enabled: bool, impl: str):
    self.spec, self.num_heads, self.dtype = spec, num_heads, dtype
    self.options = (scale, sliding_window, soft_cap, sinks)
    self.enabled, self.impl = enabled, impl
    self._decode = {}          # device -> TorchDecode, or the reason
    self._write = {}           # device -> TorchWrite, or the reason

  def _common(self) -> Optional[str]:
    if not self.enabled:
      return "direct_launch=False"
    if self.impl == "reference":
      return "impl='reference'"
    return None

  def decode(self, device, max_query_len: int):
    """The decode launcher for a ``forward`` on ``device``, or why there is none (str)."""
    why = self._common()
    if why is not None:
      return why
    if max_query_len > 1:
      return f"max_query_len={max_query_len}: the launch runs decode steps only"
    device = torch.device(device)
    got = self._decode.get(device)
    if got is None:
      from torch_bridge import mosaic_decode as MDT   # noqa: PLC0415
      got = self._decode[device] = (
          MDT.platform_reason(device) or MDT.spec_reason(self.spec, self.dtype, self.num_heads)
          or MDT.TorchDecode(self.spec, self.num_heads, *self.options))
    return got

  def write(self, device):
    """The write launcher for a ``do_kv_cache_update`` on ``device``, or why there is none."""
    why = self._common()
    if why is not None:
      return why
    device = torch.device(device)
    got = self._write.get(device)
    if got is None:
      from torch_bridge import mosaic_decode as MDT   # noqa: PLC0415
      from torch_bridge import mosaic_write as MW     # noqa: PLC0415
      got = self._write[device] = (MDT.platform_reason(device) or MW.spec_reason(self.spec)
                                   or MW.TorchWrite(self.spec))
    return got
