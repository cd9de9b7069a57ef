"""Which implementation runs an op: one registry per op, implementations tried in order.

Ops and the signature every implementation of them takes:

- :data:`WRITE` (``kvjax.write_kv``):
  ``fn(cache, key, value, slot_mapping, spec, *, k_scale, v_scale[, interpret]) -> cache``
- :data:`ATTENTION` (``kvjax.unified_attention``):
  ``fn(q, cache, spec, *, query_start_loc, seq_lens, block_table, scale, causal,
  sliding_window, soft_cap, sinks, k_scale, v_scale, max_query_len[, interpret]) -> out``
- :data:`READ` (the dequantize step of ``kvjax.read_kv``):
  ``fn(pages, spec, *, k_scale, v_scale[, interpret]) -> (k, v)``

``interpret`` is passed to implementations registered as ``interpretable`` (Pallas kernels)
only. Arguments arrive validated by the public op: implementations do not re-check them.

An implementation declares where it runs compiled (``platforms``: "cpu", "gpu", "tpu") and,
through its ``supports`` function, which calls it handles: ``supports(*args) -> None`` (yes)
or a string saying why not. The arguments of ``supports`` per op: WRITE and READ ``(spec,)``,
ATTENTION ``(spec, q_dtype)``.

``impl="auto"`` takes the first registered implementation that runs compiled on the default
backend's platform and supports the call (never an interpret-mode kernel); a named ``impl``
must support the call, and runs in interpret mode where it is not native (``interpret=None``)
or when asked (``interpret=True``). :func:`explain` says which implementation runs a call and
why the others were passed over.

Entry points and supports functions may be given as ``"module:attribute"`` strings, imported
on first use: a backend whose module cannot import on this jax (e.g. Mosaic GPU on an old
jax) is then skipped with the import error as its reason, and ``import kvjax`` stays cheap.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, List, Optional, Tuple, Union

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
Target = Union[Callable, str]


def platform() -> str:
  """The default backend's platform: "cpu", "gpu" or "tpu"."""
  return jax.default_backend()


def _load(target: Target):
  if not isinstance(target, str):
    return target
  module, _, attr = target.partition(":")
  return getattr(importlib.import_module(module), attr)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One registered implementation of an op.

  Attributes:
    name: what ``impl=`` takes.
    entry: the entry point (callable or ``"module:attr"``).
    supports: ``supports(*args) -> None | reason`` (callable, ``"module:attr"`` or None =
      every call).
    platforms: platforms it runs compiled on.
    interpretable: a Pallas kernel that also runs in interpret mode on any platform.
  """
  name: str
  entry: Target
  supports: Optional[Target]
  platforms: Tuple[str, ...]
  interpretable: bool

  @property
  def fn(self) -> Callable:
    return _load(self.entry)

  def reason(self, *args) -> Optional[str]:
    """None when this implementation handles the call, else why not."""
    try:
      _load(self.entry)
      check = None if self.supports is None else _load(self.supports)
    except ImportError as e:                                     # a backend this jax lacks
      return f"cannot import it: {e}"
    return None if check is None else check(*args)


@dataclasses.dataclass(frozen=True)
class Choice:
  """The answer of :meth:`Registry.choose`: what runs, how, and what was passed over."""
  op: str
  impl: Implementation
  interpret: bool
  platform: str
  skipped: Tuple[Tuple[str, str], ...] = ()

  @property
  def name(self) -> str:
    return self.impl.name

  def __call__(self, *args, **kwargs):
    if self.impl.interpretable:
      kwargs["interpret"] = self.interpret
    return self.impl.fn(*args, **kwargs)

  def __str__(self) -> str:
    mode = "interpret mode" if self.interpret else "compiled"
    lines = [f"{self.op} on {self.platform}: {self.name} ({mode})"]
    lines += [f"  passed over {name}: {why}" for name, why in self.skipped]
    return "\n".join(lines)


class Registry:
  """The implementations of one op, in the order ``auto`` tries them."""

  def __init__(self, op: str):
    self.op = op
    self._impls: List[Implementation] = []

  def register(self, name: str, entry: Target, *, supports: Optional[Target] = None,
               platforms=PLATFORMS, interpretable: bool = False,
               before: Optional[str] = None) -> Implementation:
    """Add an implementation (last, or just before the one named ``before``)."""
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad:
      raise ValueError(f"platforms must be among {PLATFORMS}, got {bad}")
    if name in self.names() or name == "auto":
      raise ValueError(f"{self.op}: implementation {name!r} is already registered")
    impl = Implementation(name, entry, supports, tuple(platforms), interpretable)
    pos = len(self._impls) if before is None else self.names().index(self.get(before).name)
    self._impls.insert(pos, impl)
    return impl

  def unregister(self, name: str):
    """Remove an implementation."""
    self._impls.remove(self.get(name))

  def names(self) -> List[str]:
    return [i.name for i in self._impls]

  def get(self, name: str) -> Implementation:
    for impl in self._impls:
      if impl.name == name:
        return impl
    raise ValueError(f"impl={name!r} is not an implementation of {self.op}; expected 'auto' or "
                     f"one of {self.names()}")

  def check(self, impl: str):
    """ValueError unless ``impl`` is "auto" or a registered name."""
    if not isinstance(impl, str):
      raise ValueError(f"impl must be a string, got {impl!r}")
    if impl != "auto":
      self.get(impl)

  def choose(self, impl: str, interpret, *args, on: Optional[str] = None) -> Choice:
    """Resolve ``impl`` ("auto" or a name) for a call whose supports-arguments are ``args``.

    ``on``: the platform to decide for (default: the default backend's).
    Raises ValueError when a named implementation cannot run the call.
    """
    self.check(impl)
    on = platform() if on is None else on
    if impl != "auto":
      chosen = self.get(impl)
      why = chosen.reason(*args)
      native = on in chosen.platforms
      if why is None and not native and not chosen.interpretable:
        why = f"it runs on {'/'.join(chosen.platforms)}, not {on}"
      if why is not None:
        raise ValueError(f"impl={impl!r} cannot run this {self.op}: {why}")
      interp = bool(chosen.interpretable and (not native if interpret is None else interpret))
      return Choice(self.op, chosen, interp, on)
    skipped = []
    for cand in self._impls:
      if on not in cand.platforms:
        skipped.append((cand.name, f"runs compiled on {'/'.join(cand.platforms)}, not {on}"))
        continue
      why = cand.reason(*args)
      if why is not None:
        skipped.append((cand.name, why))
        continue
      return Choice(self.op, cand, bool(cand.interpretable and interpret), on, tuple(skipped))
    raise ValueError(f"no implementation of {self.op} runs this call on {on}: " +
                     "; ".join(f"{n}: {w}" for n, w in skipped))


WRITE = Registry("write")
ATTENTION = Registry("attention")
READ = Registry("read")
REGISTRIES = {"write": WRITE, "attention": ATTENTION, "read": READ}


def explain(op: str, spec, q_dtype=None, *, impl: str = "auto", interpret=None,
            platform: Optional[str] = None) -> Choice:
  """Which implementation runs ``op`` ("write", "attention" or "read") for ``spec``, and why.

  ``q_dtype``: the query dtype (attention; default the spec's model dtype). ``platform``:
  decide for "cpu", "gpu" or "tpu" instead of the default backend. The returned
  :class:`Choice` prints as a short report:

  >>> import kvjax
  >>> spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16)
  >>> print(kvjax.explain("attention", spec, platform="gpu"))
  attention on gpu: pallas (compiled)
  >>> print(kvjax.explain("write", spec, platform="gpu", impl="reference"))
  write on gpu: reference (compiled)
  """
  if op not in REGISTRIES:
    raise ValueError(f"op={op!r} must be one of {sorted(REGISTRIES)}")
  args = (spec, spec.dtype if q_dtype is None else q_dtype) if op == "attention" else (spec,)
  return REGISTRIES[op].choose(impl, interpret, *args, on=platform)


# -- Built-in implementations: one line per (op, implementation), in the order auto tries them.
# A new backend adds its lines here (before "reference", the fallback that runs everywhere).
_TRITON = "pallas_kernels.triton"
WRITE.register("pallas", f"{_TRITON}.write:write_kv",
               supports=f"{_TRITON}.write:supports_write",
               platforms=("gpu",), interpretable=True)
ATTENTION.register("pallas", f"{_TRITON}.attention:unified_attention",
                   supports=f"{_TRITON}.attention:supports_attention", platforms=("gpu",),
                   interpretable=True)
READ.register("pallas", f"{_TRITON}.dequant:dequantize_pages",
              supports=f"{_TRITON}.dequant:supports_read", platforms=("gpu",),
              interpretable=True)
# Mosaic GPU (Hopper): after the Triton kernels, so auto keeps those until a measured rule
# (in its supports function) says where Mosaic GPU is faster; impl="mosaic_gpu" runs it.
ATTENTION.register("mosaic_gpu", "pallas_kernels.mosaic_gpu:ragged_paged_attention",
                   supports="pallas_kernels.mosaic_gpu:supports_attention", platforms=("gpu",))
WRITE.register("mosaic_tpu", "pallas_kernels.mosaic_tpu:write_kv",
               supports="pallas_kernels.mosaic_tpu:supports_write", platforms=("tpu",),
               interpretable=True)
ATTENTION.register("mosaic_tpu", "pallas_kernels.mosaic_tpu:ragged_paged_attention",
                   supports="pallas_kernels.mosaic_tpu:supports_attention", platforms=("tpu",),
                   interpretable=True)
WRITE.register("reference", "kvjax.reference.cache_update:write_kv")
ATTENTION.register("reference", "kvjax.reference.attention:unified_attention")
READ.register("reference", "kvjax.views:dequantize_pages")
