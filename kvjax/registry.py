"""Which implementation runs an op: one registry per op, implementations tried in order.

Ops and the signature every implementation of them takes:

- :data:`WRITE` (``kvjax.write_kv``):
  ``fn(cache, key, value, slot_mapping, spec, *, k_scale, v_scale[, interpret]) -> cache``
- :data:`ATTENTION` (``kvjax.unified_attention``):
  ``fn(q, cache, spec, *, query_start_loc, seq_lens, block_table, scale, causal,
  sliding_window, soft_cap, sinks, k_scale, v_scale, max_query_len[, interpret]) -> out``
- :data:`READ` (the dequantize step of ``kvjax.read_kv``):
  ``fn(pages, spec, *, k_scale, v_scale[, interpret]) -> (k, v)``
- :data:`PAGES` (``kvjax.pages.store_pages``, a transfer's receive):
  ``fn(table, rows, block_ids, *, column[, interpret]) -> table``

``interpret`` is passed to implementations registered as ``interpretable`` (Pallas kernels)
only. Arguments arrive validated by the public op: implementations do not re-check them.
Implementations compute on values in the frame the cache stores them: for a format whose
codec has a rotation (int4 per token-head), the public op rotates K/V and q and un-rotates
outputs and reads around them (:mod:`kvjax.rotation`).

An implementation declares where it runs compiled (``platforms``: "cpu", "gpu", "tpu") and,
through its ``supports`` function, which calls it handles: ``supports(*args) -> None`` (yes)
or a string saying why not. The arguments of ``supports`` per op: WRITE and READ ``(spec,)``,
ATTENTION ``(spec, q_dtype)``, PAGES ``(storage dtype, page width in elements)``. An
implementation that is faster than the ones after it only for some calls also gives a
``prefer`` rule, ``prefer(*args, call) -> None | reason``, with ``call`` the static facts of
the call (:class:`AttentionCall` for ATTENTION, None when unknown): ``auto`` passes it over
where the rule says no, a named ``impl`` runs regardless.

``impl="auto"`` takes the first registered implementation that runs compiled on the call's
platform, supports the call and (if it has a rule) is preferred for it (never an
interpret-mode kernel); a named ``impl`` must support the call, and runs in interpret mode
where it is not native (``interpret=None``) or when asked (``interpret=True``).
:func:`explain` says which implementation runs a call and why the others were passed over.
The call's platform is that of the device the cache is on; a cache traced under ``jit`` has
none yet, so the public ops choose for every platform of the process and the lowering keeps
the branch of the platform it lowers for (:meth:`Registry.routes`).

Entry points and supports functions may be given as ``"module:attribute"`` strings, imported
on first use: a backend whose module cannot import on this jax (e.g. Mosaic GPU on an old
jax) is then skipped with the import error as its reason, and ``import kvjax`` stays cheap.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Callable, List, Optional, Tuple, Union

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
Target = Union[Callable, str]


@dataclasses.dataclass(frozen=True)
class AttentionCall:
  """Static facts of one attention call, for the ``prefer`` rules of :data:`ATTENTION`.

  Attributes:
    num_tokens: T, query tokens (padding included).
    num_q_heads: Hq.
    num_seqs: S.
    max_blocks: block-table width.
    max_query_len: the caller's static bound on any sequence's query length (None: unknown,
      up to T).
  """
  num_tokens: int
  num_q_heads: int
  num_seqs: int
  max_blocks: int
  max_query_len: Optional[int] = None


#: Device platform names and the registry platform they run.
DEVICE_PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}


def platform() -> str:
  """The platform computations go to by default: that of ``jax.default_device`` where it is
  set (a device or a platform name), else the default backend's ("cpu", "gpu" or "tpu")."""
  dev = jax.config.jax_default_device
  if dev is None:
    return jax.default_backend()
  name = dev if isinstance(dev, str) else dev.platform
  return DEVICE_PLATFORMS.get(name, name)


def platform_of(array) -> str:
  """The platform an op on ``array`` runs on: a concrete JAX array's (its devices'), else (a
  traced value, a numpy array) :func:`platform`'s. A cache placed on the CPU of a GPU machine
  is then written and read on the CPU, by an implementation that runs there. (A traced cache
  is placed only when the jitted call runs: :meth:`Registry.routes` then lets the lowering
  decide.)

  >>> import jax, jax.numpy as jnp
  >>> platform_of(jax.device_put(jnp.zeros(2), jax.devices("cpu")[0]))
  'cpu'
  """
  if isinstance(array, jax.core.Tracer) or not isinstance(array, jax.Array):
    return platform()
  return next(iter(array.devices())).platform


def host_platforms() -> Tuple[str, ...]:
  """The platforms this process has devices of, in :data:`PLATFORMS` order (a GPU machine:
  ``("cpu", "gpu")``)."""
  found = []
  for name in PLATFORMS:
    try:
      if jax.devices(name):
        found.append(name)
    except RuntimeError:                       # no backend of that platform here
      pass
  return tuple(found)


#: The names ``jax.lax.platform_dependent`` gives the lowerings of each platform.
LOWERINGS = {"cpu": ("cpu",), "gpu": ("cuda", "rocm"), "tpu": ("tpu",)}


def load_target(target: Target):
  """A callable, or the object a ``"module:attribute"`` string names (imported now)."""
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
    prefer: ``prefer(*args, call) -> None | reason``: where ``auto`` takes it (None = every
      supported call).
    xla: made of plain XLA ops (jnp), not an opaque kernel call: a slice of its inputs
      fuses into its ops instead of being copied (what lets it read an HND layered cache,
      :mod:`kvjax.layers`).
    model_frame: an attention implementation that takes q and gives its output in the
      model's frame, applying the format's rotation (``spec.codec.rotation``) itself; the
      others get q rotated and have their output un-rotated by the op
      (:func:`kvjax.unified_attention`).
  """
  name: str
  entry: Target
  supports: Optional[Target]
  platforms: Tuple[str, ...]
  interpretable: bool
  prefer: Optional[Target] = None
  xla: bool = False
  model_frame: bool = False

  @property
  def fn(self) -> Callable:
    return load_target(self.entry)

  def reason(self, *args, also=None) -> Optional[str]:
    """None when this implementation handles the call, else why not. ``also``: a further
    condition of the call, ``also(implementation) -> None | reason``."""
    try:
      load_target(self.entry)
      check = None if self.supports is None else load_target(self.supports)
    except ImportError as e:                                     # a backend this jax lacks
      return f"cannot import it: {e}"
    why = None if check is None else check(*args)
    return why if why is not None or also is None else also(self)

  def not_preferred(self, *args, call=None) -> Optional[str]:
    """None when ``auto`` should take this implementation for the call, else why not."""
    return None if self.prefer is None else load_target(self.prefer)(*args, call)


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

  @property
  def mode(self) -> str:
    """How it runs: "interpret mode" or "compiled"."""
    return "interpret mode" if self.interpret else "compiled"

  def __str__(self) -> str:
    lines = [f"{self.op} on {self.platform}: {self.name} ({self.mode})"]
    lines += [f"  passed over {name}: {why}" for name, why in self.skipped]
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Routes:
  """What runs an op on each platform the call may be lowered for (:meth:`Registry.routes`).

  Attributes:
    primary: the choice for :func:`platform_of` the cache (and for any platform not listed).
    others: the choices for the process's other platforms (empty for a placed cache).
  """
  primary: Choice
  others: Tuple[Choice, ...] = ()

  @property
  def branches(self) -> Tuple[Choice, ...]:
    """The choices the call lowers to: one when every platform takes the same
    implementation in the same mode, else one a platform."""
    key = lambda c: (c.name, c.interpret)
    if all(key(c) == key(self.primary) for c in self.others):
      return (self.primary,)
    return (self.primary, *self.others)

  def run(self, body: Callable):
    """``body(choice)`` for the one choice, or under ``jax.lax.platform_dependent`` one
    branch a platform: a call lowered for one platform keeps that platform's branch only
    (the others are never lowered, so a GPU kernel is not lowered for the CPU), and its
    values (a donated cache too) pass straight through."""
    branches = self.branches
    if len(branches) == 1:
      return body(self.primary)
    per_lowering = {name: functools.partial(body, choice)
                    for choice in branches for name in LOWERINGS[choice.platform]}
    return jax.lax.platform_dependent(default=functools.partial(body, self.primary),
                                      **per_lowering)


class Registry:
  """The implementations of one op, in the order ``auto`` tries them."""

  def __init__(self, op: str):
    self.op = op
    self._impls: List[Implementation] = []

  def register(self, name: str, entry: Target, *, supports: Optional[Target] = None,
               platforms=PLATFORMS, interpretable: bool = False, xla: bool = False,
               before: Optional[str] = None, prefer: Optional[Target] = None,
               model_frame: bool = False) -> Implementation:
    """Add an implementation (last, or just before the one named ``before``); ``prefer``:
    its auto rule (module docstring); the other flags: :class:`Implementation`."""
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad:
      raise ValueError(f"platforms must be among {PLATFORMS}, got {bad}")
    if name in self.names() or name == "auto":
      raise ValueError(f"{self.op}: implementation {name!r} is already registered")
    impl = Implementation(name, entry, supports, tuple(platforms), interpretable, prefer, xla,
                          model_frame)
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

  def choose(self, impl: str, interpret, *args, on: Optional[str] = None, call=None,
             also=None) -> Choice:
    """Resolve ``impl`` ("auto" or a name) for a call whose supports-arguments are ``args``.

    ``on``: the platform to decide for (default: the default backend's). ``call``: the
    call's static facts for the ``prefer`` rules (:class:`AttentionCall`; None: unknown).
    ``also``: a further condition of this call on the implementation (``also(impl) -> None |
    reason``, e.g. :func:`kvjax.layers.attention_condition`).
    Raises ValueError when a named implementation cannot run the call.
    """
    self.check(impl)
    on = platform() if on is None else on
    if impl != "auto":
      chosen = self.get(impl)
      why = chosen.reason(*args, also=also)
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
      why = cand.reason(*args, also=also)
      if why is None:
        why = cand.not_preferred(*args, call=call)
      if why is not None:
        skipped.append((cand.name, why))
        continue
      return Choice(self.op, cand, bool(cand.interpretable and interpret), on, tuple(skipped))
    raise ValueError(f"no implementation of {self.op} runs this call on {on}: " +
                     "; ".join(f"{n}: {w}" for n, w in skipped))

  def routes(self, impl: str, interpret, *args, array, call=None, also=None) -> Routes:
    """:meth:`choose` for a call on ``array`` (the cache): for the platform it is placed on;
    traced (under ``jit``, placed only when the call runs), for every platform of this
    process, so that :meth:`Routes.run` lowers the right one (a jitted step on a cache
    placed on the CPU of a GPU machine runs an implementation that runs on the CPU).
    Only compiled choices become branches: an interpret-mode kernel runs on any platform (a
    primary in interpret mode is the one route), and its host callbacks are effects that a
    pruned branch cannot carry through lowering. Platforms a named ``impl`` cannot run on, or
    runs on in interpret mode only, are left out: they take the primary's branch.
    """
    primary = self.choose(impl, interpret, *args, on=platform_of(array), call=call, also=also)
    if primary.interpret or not isinstance(array, jax.core.Tracer):
      return Routes(primary)
    others = []
    for name in host_platforms():
      if name == primary.platform:
        continue
      try:
        choice = self.choose(impl, interpret, *args, on=name, call=call, also=also)
      except ValueError:
        continue
      if not choice.interpret:
        others.append(choice)
    return Routes(primary, tuple(others))


WRITE = Registry("write")
ATTENTION = Registry("attention")
READ = Registry("read")
PAGES = Registry("pages")
REGISTRIES = {"write": WRITE, "attention": ATTENTION, "read": READ, "pages": PAGES}


def explain(op: str, spec, q_dtype=None, *, impl: str = "auto", interpret=None,
            platform: Optional[str] = None, call: Optional[AttentionCall] = None,
            layered: bool = False) -> Choice:
  """Which implementation runs ``op`` ("write", "attention", "read" or "pages") for ``spec``,
  and why.

  ``q_dtype``: the query dtype (attention; default the spec's model dtype). ``platform``:
  decide for "cpu", "gpu" or "tpu" (or a device platform name: "cuda", "rocm") instead of
  the default backend. ``call``: the shapes of an
  attention call (:class:`AttentionCall`), for the rules that depend on them. ``layered``:
  for a layered (cross-layer) cache with ``layer=`` (:mod:`kvjax.layers`). The returned
  :class:`Choice` prints as a short report:

  >>> import kvjax
  >>> spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16)
  >>> print(kvjax.explain("write", spec, platform="gpu"))
  write on gpu: pallas (compiled)
  >>> print(kvjax.explain("write", spec, platform="gpu", impl="reference"))
  write on gpu: reference (compiled)
  """
  if op not in REGISTRIES:
    raise ValueError(f"op={op!r} must be one of {sorted(REGISTRIES)}")
  if platform is not None:
    platform = DEVICE_PLATFORMS.get(platform, platform)
    if platform not in PLATFORMS:
      raise ValueError(f"platform={platform!r} must be one of {list(PLATFORMS)} (or a device "
                       f"platform name: {sorted(DEVICE_PLATFORMS)}), or None for the default "
                       "backend")
  if op == "attention":
    args = (spec, spec.dtype if q_dtype is None else q_dtype)
  elif op == "pages":
    args = (spec.storage_dtype, math.prod(spec.physical_shape(1)[1:]))
  else:
    args = (spec,)
  also = None
  if layered and op == "attention":
    from kvjax.layers import attention_condition
    also = attention_condition(spec)
  return REGISTRIES[op].choose(impl, interpret, *args, on=platform, call=call, also=also)


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
PAGES.register("pallas", f"{_TRITON}.page_copy:store_pages",
               supports=f"{_TRITON}.page_copy:supports_pages", platforms=("gpu",),
               interpretable=True)
# Mosaic GPU (Hopper): before the Triton kernels, taken by auto where its measured rule
# (pallas_kernels.mosaic_gpu.attention.prefer_attention) says it is faster.
ATTENTION.register("mosaic_gpu", "pallas_kernels.mosaic_gpu:unified_attention",
                   supports="pallas_kernels.mosaic_gpu:supports_attention", platforms=("gpu",),
                   prefer="pallas_kernels.mosaic_gpu:prefer_attention", before="pallas",
                   model_frame=True)
WRITE.register("mosaic_tpu", "pallas_kernels.mosaic_tpu:write_kv",
               supports="pallas_kernels.mosaic_tpu:supports_write", platforms=("tpu",),
               interpretable=True)
ATTENTION.register("mosaic_tpu", "pallas_kernels.mosaic_tpu:ragged_paged_attention",
                   supports="pallas_kernels.mosaic_tpu:supports_attention", platforms=("tpu",),
                   prefer="pallas_kernels.mosaic_tpu:prefer_attention", interpretable=True)
# Plain XLA ops (jnp): blocked over keys, gathering only the batch's pages; auto takes it on
# the CPU, and on a GPU for calls no kernel above supports. (TPU once its tests have run
# compiled there.)
ATTENTION.register("xla", "kvjax.xla_attention:unified_attention", platforms=("cpu", "gpu"),
                   xla=True)
WRITE.register("reference", "kvjax.reference.cache_update:write_kv", xla=True)
ATTENTION.register("reference", "kvjax.reference.attention:unified_attention", xla=True)
READ.register("reference", "kvjax.views:dequantize_stored", xla=True)
PAGES.register("reference", "kvjax.pages:store_pages_reference", xla=True)
