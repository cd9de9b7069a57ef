"""Which of a backend's calls launch kvjax's kernels from torch, per device, and why not.

:class:`TorchLaunches` keeps, per torch device, the launcher of each call
(:class:`torch_bridge.mosaic_decode.TorchDecode`, :class:`torch_bridge.mosaic_ragged.TorchRagged`,
:class:`torch_bridge.mosaic_write.TorchWrite`) or the reason there is none; a call asks it
(host-only, O(1) after the first call per device) and goes through JAX when the answer is a
reason.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

import kvjax

#: What ``PagedAttentionBackend.last_path`` / ``last_write_path`` say of a launched call.
DECODE_PATH = "mosaic_gpu decode launched from torch"
RAGGED_PATH = "mosaic_gpu ragged launched from torch"
WRITE_PATH = "mosaic_gpu write launched from torch"


class LastPath:
  """A backend attribute that says which path its last call took: set to one of the strings
  above (a launch) or to the arguments of :func:`jax_path` (a call through JAX), formatted
  only when read (asking the registry costs more than a call)."""

  def __set_name__(self, owner, name):
    self.slot = "_" + name

  def __get__(self, obj, owner=None):
    if obj is None:
      return self
    value = getattr(obj, self.slot, None)
    return jax_path(*value) if isinstance(value, tuple) else value

  def __set__(self, obj, value):
    setattr(obj, self.slot, value)


@functools.lru_cache(maxsize=256)
def jax_path(spec, op: str, why: str, impl: str, interpret, on_cuda: bool, call=None,
             layered: bool = False) -> str:
  """What ``last_path`` / ``last_write_path`` say of a call through JAX: the implementation
  the registry takes for it (:func:`kvjax.explain` for the tensors' platform; ``call``: the
  attention call's :class:`kvjax.registry.AttentionCall`) and ``why`` it is not launched."""
  choice = kvjax.explain(op, spec, impl=impl, interpret=interpret, call=call,
                         platform="gpu" if on_cuda else "cpu", layered=layered)
  return f"jax ({choice.name}{', interpret mode' if choice.interpret else ''}): {why}"


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
    self._decode = {}          # device -> the decode launch, or the reason
    self._ragged = {}          # device -> the ragged launch, or the reason
    self._write = {}           # device -> TorchWrite, or the reason

  def _common(self) -> Optional[str]:
    if not self.enabled:
      return "direct_launch=False"
    if self.impl == "reference":
      return "impl='reference'"
    return None

  def attention(self, device, max_query_len: int, layered: bool):
    """A ``forward`` on ``device``: a function ``(q, phys, metadata, out, k_scale, v_scale,
    layer) -> path`` that launches it, or why there is none (str). Decode steps
    (``max_query_len <= 1``) take the decode kernel; longer queries of plain caches the
    ragged kernel, from the length at which ``auto`` takes it in JAX (measured:
    ``pallas_kernels.mosaic_gpu.tuning.AUTO_MIN_QUERY_LEN``)."""
    why = self._common()
    if why is not None:
      return why
    device = torch.device(device)
    if max_query_len <= 1:
      got = self._launcher(self._decode, device, self._new_decode)
      if layered and not isinstance(got, str):
        from torch_bridge import mosaic_decode as MDT   # noqa: PLC0415
        return MDT.layered_reason(self.spec) or got
      return got
    from pallas_kernels.mosaic_gpu import tuning as MT   # noqa: PLC0415
    if max_query_len < MT.AUTO_MIN_QUERY_LEN:
      return (f"max_query_len={max_query_len}: below {MT.AUTO_MIN_QUERY_LEN} the Triton "
              "kernels (through JAX) are faster than the ragged kernel")
    if layered:
      return "a layered cache: the ragged kernel reads one layer's cache"
    return self._launcher(self._ragged, device, self._new_ragged)

  @staticmethod
  def _launcher(kept: dict, device, make):
    got = kept.get(device)
    if got is None:
      got = kept[device] = make(device)
    return got

  def _new_decode(self, device):
    from torch_bridge import mosaic_decode as MDT   # noqa: PLC0415
    why = MDT.platform_reason(device) or MDT.spec_reason(self.spec, self.dtype, self.num_heads)
    if why is not None:
      return why
    run = MDT.TorchDecode(self.spec, self.num_heads, *self.options)

    def launch(q, phys, metadata, out, k_scale, v_scale, layer):
      run(q, phys, *metadata.int32_tensors(), out, k_scale, v_scale, layer)
      return DECODE_PATH
    return launch

  def _new_ragged(self, device):
    from torch_bridge import mosaic_decode as MDT   # noqa: PLC0415
    from torch_bridge import mosaic_ragged as MRT   # noqa: PLC0415
    why = MDT.platform_reason(device) or MRT.spec_reason(self.spec, self.dtype,
                                                          self.num_heads)
    if why is not None:
      return why
    run = MRT.TorchRagged(self.spec, self.num_heads, *self.options)

    def launch(q, phys, metadata, out, k_scale, v_scale, layer):
      del k_scale, v_scale, layer     # a plain one-layer cache
      run(q, phys, *metadata.int32_tensors(), out, metadata.max_query_len, metadata.causal)
      return RAGGED_PATH
    return launch

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
