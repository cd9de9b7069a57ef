"""The Mosaic GPU kernels' per-format hooks: how K/V tiles copied from the cache become wgmma
operands.

The Mosaic GPU adapter table (:mod:`.adapters`) gives each codec its hook class from the
codec's facts; the kernels are format-blind.
A hook object is static (frozen, hashable) and answers:

- :meth:`Operands.landing` -- the shared-memory slots one side's TMA copies land in
  (``stages`` slots of ``(T, D)`` storage elements, tiled with the format's swizzle, by
  default the widest that fits: a TMA copy moves rows of at most the swizzle's width, so
  narrower swizzles cost more copies);
- :meth:`Operands.k_operand` -- in the kernel: K of a step as the A operand of ``S^T = K q^T``
  (the landing slot itself, or converted values in registers);
- :meth:`Operands.prepare_v` -- in the kernel: V of a step in the compute dtype, written to a
  buffer of the layout ``V^T P^T`` reads (the transposed A operand, which wgmma takes from
  shared memory only, with the narrow swizzle ``P^T``'s 16 columns allow), the rows of keys
  the step must not see set to 0 (stale cache bytes may be NaN, and ``0 * NaN`` would reach
  the output);

:class:`PlainOperands` (bf16 / f16 caches read with queries of their dtype): K is read where it
lands. :class:`Fp8Operands` (fp8 per tensor, e4m3 / e5m2): K is converted to float16 in
registers (loaded four bytes at a time, one warp shuffle to the wgmma register layout), V to
float16 on its way to the V buffer (every e4m3 / e5m2 value is exact in float16; e4m3 -> f16
is one instruction per two values on Hopper). Queries go to float16 too (saturating): one
operand-dtype rule for every GPU kernel, :func:`pallas_kernels.common.compute_dtype`. The
global K / V scales come from the codec (:meth:`kvjax.codecs.Codec.tensor_scales`).
Formats with a scale per (token, head) row (int8 / fp8 / int4 per token-head) have their
hooks in :mod:`.row_formats`, nvfp4 (a scale per 16 values) in :mod:`.group_formats`.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import SIXTEEN_BIT, as_operand, compute_dtype
from pallas_kernels.mosaic_gpu.tuning import FP8_LANDING_SWIZZLE


@dataclasses.dataclass(frozen=True)
class Operands:
  """Static facts of one cache format for the Mosaic GPU kernels (base of the hook classes).

  Attributes:
    storage: the cache array's dtype.
    compute: the dtype of the wgmma operands (q's too):
      :func:`pallas_kernels.common.compute_dtype`, the rule of every GPU kernel.
    ptx: whether the kernel is compiled for CUDA, where the hooks may convert codes with
      inline PTX (:mod:`.nibbles`); Mosaic GPU's interpret mode runs none.
  """
  storage: np.dtype
  compute: np.dtype
  ptx: bool = False

  @classmethod
  def of(cls, spec, q_dtype) -> "Operands":
    """The hooks of ``spec``'s format for ``q_dtype`` queries."""
    return cls(storage=np.dtype(spec.storage_dtype),
               compute=compute_dtype(spec.codec, spec.storage_dtype, q_dtype))

  @classmethod
  def reason(cls, spec, q_dtype) -> Optional[str]:
    """None when this format and ``q_dtype`` run, else why not."""
    if np.dtype(q_dtype) not in SIXTEEN_BIT:
      return f"q dtype {np.dtype(q_dtype)}: the Mosaic GPU kernels take bfloat16/float16"
    return None

  #: Swizzle (bytes) of the landing slots; None = the widest that fits.
  landing_swizzle: ClassVar[Optional[int]] = None
  #: Whether each side row ends in a float32 scale the kernel reads per key (the V scales
  #: multiply the softmax weights: the kernel waits for a step's V copy before storing them).
  row_scaled: ClassVar[bool] = False
  #: How many per-query sums :meth:`scale_scores` takes (:meth:`q_sums`).
  num_q_sums: ClassVar[int] = 0
  #: Whether :meth:`k_operand` gives registers (Mosaic GPU interpret mode takes no register
  #: wgmma operand: the kernel then stores them to a buffer first).
  k_in_registers: ClassVar[bool] = False
  #: Whether each side's copies also bring a second box, the side's group scales: then
  #: :meth:`landing` gives ``(data slots, scale slots, staging)`` and the hooks read a step's
  #: ``(data slot, scale slot, staging)`` (:mod:`.group_formats`).
  scale_copies: ClassVar[bool] = False
  #: Whether the kernel computes in another order of the head dim than the cache's
  #: (:meth:`q_operand` and :meth:`output` permute it).
  reorders_dims: ClassVar[bool] = False
  #: Whether the ragged (prefill) kernel reads this format's pages as they are stored: its
  #: producer warpgroup turns each landed step into plain K/V with :meth:`plain_values`
  #: (:mod:`.ragged_landing`); otherwise it reads a plain copy of the batch's pages.
  ragged_direct: ClassVar[bool] = False

  def landing(self, stages: int, rows: int, cols: int, tiled, side: int = 0):
    """One side's (0: K, 1: V) TMA slots ``(stages, rows, cols)``; ``tiled(shape, dtype,
    swizzle)`` makes a buffer wgmma reads (``swizzle`` None: the widest that fits)."""
    return tiled((stages, rows, cols), self.storage, self.landing_swizzle)

  def step_slot(self, land, slot, interpret: bool):
    """What the hooks read of a step: slot ``slot`` of :meth:`landing`'s buffers."""
    return land.at[slot]

  def landing_cols(self, head_size: int) -> int:
    """Storage elements of a landing slot's row (what one side row's TMA copy moves)."""
    return head_size

  def scratch_bytes(self, block_kv: int, head_size: int) -> int:
    """Shared memory of one side's :meth:`landing` besides its slots."""
    return 0

  def k_operand(self, slot_ref):
    """K of a step as the A operand of ``S^T = K q^T``: a ``(T, D)`` ref or registers."""
    return slot_ref

  def score_operands(self, slot_ref, q_smem):
    """The wgmma operand pairs ``(A, B)`` whose products sum to ``S^T`` of a step (before
    scales): ``K q^T``, A a ``(T, k)`` ref or registers, B ``(k, 16)``."""
    return ((self.k_operand(slot_ref), q_smem.transpose((1, 0))),)

  def q_sums(self, q_op):
    """float32 ``[..., num_q_sums, Hq]``: per-query sums of :meth:`q_operand`'s rows that
    :meth:`scale_scores` takes (None: none)."""
    return None

  def q_swizzle(self, head_size: int) -> Optional[int]:
    """Swizzle (bytes) of the q buffer wgmma reads (None: the widest that fits)."""
    return None

  def scale_scores(self, sc, slot_ref, factor, q_sums):
    """``S^T`` (float32 ``(T, 16)``, WGMMA layout) in the log2 domain: times ``factor`` (softmax
    scale x log2 e x the K tensor scale); q_sums: :meth:`q_sums` of the query columns, each
    ``(16,)``."""
    return sc * factor

  def value_state(self, shape):
    """Per-thread state the format carries through the key loop (None: none)."""
    return None

  def value_weights(self, p, slot_ref, visible, alpha, state):
    """``(weights, state)`` of a step: what ``V^T P^T`` takes as ``P^T`` (float32 ``(T, 16)``:
    the softmax weights ``p``; visible: bool ``(T, 16)``, the keys the query sees), and the
    format's state after the step (``alpha`` ``(16,)`` rescales it first; None for a round's
    later steps)."""
    return p, state

  def finish_values(self, acc, state):
    """``O^T`` (float32 ``(D, 16)``) from the accumulator and the state."""
    return acc

  def output(self, out):
    """The kernel's output ``[..., D]`` in the head dim's order (formats whose kernel
    computes in another order put it back)."""
    return out

  def v_values(self, slot_ref):
    """V of a step in the compute dtype, in the WGMMA register layout."""
    raise NotImplementedError

  def prepare_v(self, slot_ref, v_ref, keep_row, commit):
    """Write V of a step to ``v_ref`` (the ``V^T P^T`` operand buffer), in the kernel.

    keep_row: None, or ``(rows, lo, hi)``: int32 ``(T, D)`` row indices in the WGMMA layout
    and the bounds of the rows to keep (the others are set to 0); commit: makes
    generic-proxy stores visible to wgmma.
    """
    x = self.v_values(slot_ref)
    if keep_row is not None:
      rows, lo, hi = keep_row
      x = jnp.where((rows >= lo) & (rows < hi), x, 0)
    v_ref[...] = x.astype(self.compute)
    commit()

  def q_operand(self, q):
    """q in the compute dtype (:func:`pallas_kernels.common.as_operand`)."""
    return as_operand(q, self.compute)

  def plain_values(self, rows_ref, scale, dtype):
    """A ``(64, 64)`` chunk of one side's landed step as a plain cache of ``dtype`` holds it,
    in the WGMMA register layout: the stored values times ``scale`` (a float32 scalar: the
    side's tensor scale) in float32, rounded once to ``dtype``, as
    :func:`kvjax.plain_copy.plain_pages` gives them. For :attr:`ragged_direct` formats."""
    raise NotImplementedError(f"{type(self).__name__} has no direct ragged read")


def even_odd(x, odd_factor: float = 1.0):
  """``x [..., D]`` in the order ``[even dims | odd dims * odd_factor]`` (the order of kernels
  that read two codes a byte, the low nibble the even dim), in x's dtype."""
  return jnp.concatenate([x[..., 0::2], x[..., 1::2] * odd_factor], axis=-1).astype(x.dtype)


def from_even_odd(out):
  """Inverse of :func:`even_odd`'s permutation: ``[..., D]`` back in the head dim's order."""
  d = out.shape[-1]
  back = np.empty(d, np.int32)
  back[0::2] = np.arange(d // 2)
  back[1::2] = d // 2 + np.arange(d // 2)
  return out[..., back]


@dataclasses.dataclass(frozen=True)
class PlainOperands(Operands):
  """bf16 / f16 caches read with queries of the same dtype: K is read where it lands."""

  @classmethod
  def reason(cls, spec, q_dtype) -> Optional[str]:
    why = super().reason(spec, q_dtype)
    if why is not None:
      return why
    storage = np.dtype(spec.storage_dtype)
    if storage not in SIXTEEN_BIT:
      return f"cache storage {storage}: the Mosaic GPU kernels take bfloat16/float16"
    if np.dtype(q_dtype) != storage:
      return f"q dtype {np.dtype(q_dtype)} differs from the cache's {storage}"
    return None

  def v_values(self, slot_ref):
    from jax.experimental.pallas import mosaic_gpu as plgpu   # noqa: PLC0415
    from pallas_kernels.mosaic_gpu.compat import load_whole   # noqa: PLC0415
    return load_whole(slot_ref, layout=plgpu.Layout.WGMMA)


@dataclasses.dataclass(frozen=True)
class Fp8Operands(Operands):
  """fp8 per tensor (e4m3 / e5m2): K becomes float16 in registers, V on its way to the V
  buffer."""
  #: Bytes land with the swizzle the upcast loads read fastest (:mod:`.tuning`).
  landing_swizzle: ClassVar[Optional[int]] = FP8_LANDING_SWIZZLE
  k_in_registers: ClassVar[bool] = True

  def _to_f16(self, slot_ref):
    """The slot's values as float16 in the WGMMA register layout: 4-byte loads of the bytes
    (the layout made for upcasts), then one warp shuffle."""
    from jax.experimental.pallas import mosaic_gpu as plgpu   # noqa: PLC0415
    from pallas_kernels.mosaic_gpu.compat import load_whole   # noqa: PLC0415
    x = load_whole(slot_ref, layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(self.compute)
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)

  ragged_direct: ClassVar[bool] = True

  def k_operand(self, slot_ref):
    return self._to_f16(slot_ref)

  def v_values(self, slot_ref):
    return self._to_f16(slot_ref)

  def plain_values(self, rows_ref, scale, dtype):
    from jax.experimental.pallas import mosaic_gpu as plgpu   # noqa: PLC0415
    from pallas_kernels.mosaic_gpu.compat import load_whole   # noqa: PLC0415
    x = load_whole(rows_ref, layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
    x = (x.astype(jnp.float32) * scale).astype(dtype)      # e4m3 / e5m2 are exact in f16
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)
