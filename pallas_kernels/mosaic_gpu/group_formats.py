"""Mosaic GPU hooks (:mod:`.formats`) of nvfp4: e2m1 codes two a byte, one e4m3 scale per 16
values (:mod:`kvjax.codecs.nvfp4`; HND only).

**Copies.** The kernel reads the cache through a view with rows of ``W = D/2`` bytes
(:func:`.decode.cache_view_shape`): per block and side, row ``h N + t`` holds head h's data
of token t, row ``H N + (h N + t) / 8`` the scales of 8 tokens (``S = D/16`` each). A side's
step lands as ``(T, W)`` data bytes and ``(T/8, W)`` scale bytes, in the cache's byte order:
K's scales per token (``[t][s]``), V's 4x4-swizzled (byte ``4 s + t % 4`` of each 4-token
group of ``4 S`` bytes: :func:`kvjax.quant.nvfp4_v_scale_position`).

**Scales.** Each thread needs, for its rows, the scale of every group: a row vector of the
step's keys per group (the WGMMA row layout), broadcast to the group's 8 columns of a nibble
half and concatenated into a ``(T, W)`` float16 scale array (a register concatenation).
K: the scale bytes go through a ``(T, S)`` float32 staging buffer, and a group's row vector is
a load of its column (two scalar loads a thread). V: each thread stores its 4 bytes
``[a][s][0:4]`` of a 4-token group ``a`` to ``staging[s, 4 a:4 a + 4]`` of an ``(S, T)``
buffer (through a reshaped, transposed view; interpret mode, which takes no reshaped view,
stores the same values through a transpose of registers) and reads group s's row vector from
row s. The e4m3 bytes become float32 from their bits (times
``2**120``, the bias difference: exact, subnormals included).

**Values.** The data bytes move from the 4-byte upcast layout to the WGMMA one as bytes (one
warp shuffle and one byte permute per 4 bytes); compiled, a byte permute through a table gives
two codes' float16 values at once (:mod:`.nibbles`); interpret mode, which runs no inline PTX,
places a nibble's 3 magnitude bits at float16 bits 9-11 and its sign at bit 15, its value times
``2**-14`` (:func:`kvjax.quant.e2m1_pair_to_f16`), times ``2**14``. Then times the group scale,
exact in float16 (``|e2m1 x e4m3| <= 2688``). The global K / V scales are the per-head factors
(:meth:`kvjax.codecs.Codec.tensor_scales`). The kernel computes in the order ``[even dims | odd
dims]`` (low nibble: the even dim): :meth:`q_operand` and :meth:`output` permute.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from kvjax import quant
from pallas_kernels.mosaic_gpu import nibbles
from pallas_kernels.mosaic_gpu.compat import JAX_VERSION
from pallas_kernels.mosaic_gpu.formats import Operands, even_odd, from_even_odd

#: Tokens whose scales share a row of the cache view (``W / S``).
TOKENS_PER_SCALE_ROW = 8
_E4M3_BIAS_SHIFT = np.float32(2.0 ** 120)    # float32 bias 127 - e4m3 bias 7


def _mgpu():
  from jax import lax   # noqa: PLC0415
  from jax.experimental import pallas as pl   # noqa: PLC0415
  from jax.experimental.pallas import mosaic_gpu as plgpu   # noqa: PLC0415
  from pallas_kernels.mosaic_gpu.compat import load_whole   # noqa: PLC0415
  return lax, pl, plgpu, load_whole


def e4m3_bits_to_f32(b):
  """int32 e4m3 bit patterns (0..255) -> float32 values, exact (no NaN: 0x7F reads 480)."""
  lax, _, _, _ = _mgpu()
  bits = lax.shift_left(b & 0x7F, 20) | lax.shift_left(b & 0x80, 24)
  return lax.bitcast_convert_type(bits, jnp.float32) * _E4M3_BIAS_SHIFT


@dataclasses.dataclass(frozen=True)
class Nvfp4Operands(Operands):
  """nvfp4 (HND): a side's step is a :class:`GroupSlot`; K's operand is registers."""
  k_in_registers: ClassVar[bool] = True
  scale_copies: ClassVar[bool] = True
  reorders_dims: ClassVar[bool] = True
  tokens_per_scale_row: ClassVar[int] = TOKENS_PER_SCALE_ROW

  @classmethod
  def reason(cls, spec, q_dtype) -> Optional[str]:
    why = super().reason(spec, q_dtype)
    if why is None and JAX_VERSION < (0, 11):
      why = "nvfp4 in the decode kernel needs jax >= 0.11 (Mosaic GPU's register concatenation)"
    if why is None and spec.head_size % 128:
      why = (f"head_size={spec.head_size}: nvfp4's group scales stage as rows of D/16 values, "
             "a multiple of 8 (D = 128 or 256)")
    return why

  def landing(self, stages: int, rows: int, cols: int, tiled, side: int = 0):
    _, _, plgpu, _ = _mgpu()
    w, s = cols // 2, cols // 16
    staging = (rows, s) if side == 0 else (s, rows)
    return (plgpu.SMEM((stages, rows, w), jnp.uint8),
            plgpu.SMEM((stages, rows // TOKENS_PER_SCALE_ROW, w), jnp.uint8),
            plgpu.SMEM(staging, jnp.float32))

  def landing_cols(self, head_size: int) -> int:
    return head_size // 2 + head_size // 16

  def scratch_bytes(self, block_kv: int, head_size: int) -> int:
    return block_kv * head_size // 16 * 4

  def q_operand(self, q):
    return even_odd(super().q_operand(q))

  def output(self, out):
    return from_even_odd(out)

  # -- in the kernel ---------------------------------------------------------------------------
  def _scale_bytes(self, scale_ref):
    """The slot's scale bytes as int32 ``(T/8, W)`` (4 consecutive bytes a thread)."""
    _, _, plgpu, load_whole = _mgpu()
    x = load_whole(scale_ref, layout=plgpu.Layout.WG_STRIDED(tuple(scale_ref.shape), 4))
    return x.astype(jnp.int32)

  def _k_group_scales(self, scale_ref, staging, commit):
    """K: float32 ``(T,)`` scale of each key for each group (WGMMA row layout), read from the
    group's column of the staged ``(T, S)`` scales."""
    _, _, plgpu, load_whole = _mgpu()
    t, s = staging.shape
    staging[...] = e4m3_bits_to_f32(self._scale_bytes(scale_ref)).reshape(t, s)
    commit()
    return [load_whole(staging.at[:, g], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            for g in range(s)]

  def _v_group_scales(self, scale_ref, staging, commit, interpret: bool):
    """V: float32 ``(T,)`` scale of each key for each group (WGMMA row layout)."""
    _, _, plgpu, load_whole = _mgpu()
    s, t = staging.shape
    x = e4m3_bits_to_f32(self._scale_bytes(scale_ref)).reshape(t // 4, s, 4)   # [a][s][d]
    if interpret:      # staging[s, 4 a + d] = x[a, s, d]
      staging[...] = x.transpose((1, 0, 2)).reshape(s, t)
    else:
      staging.reshape(s, t // 4, 4).transpose((1, 0, 2))[...] = x
    commit()
    return [load_whole(staging.at[g], layout=plgpu.Layout.WGMMA.reduce(1)) for g in range(s)]

  def _values(self, data_ref, group_scales):
    """The slot's values ``[even | odd]``, float16 ``(T, D)`` in the WGMMA layout, each times
    its group scale. Compiled: byte permutes through a table (:mod:`.nibbles`); interpret
    mode: the codes' bits placed under float16's (the same values)."""
    lax, _, plgpu, load_whole = _mgpu()
    wgmma = plgpu.Layout.WGMMA
    t = data_ref.shape[0]
    scale = jnp.concatenate([lax.broadcast_in_dim(g.astype(jnp.float16), (t, 8), [0])
                             for g in group_scales], axis=1)
    w = load_whole(data_ref, layout=plgpu.Layout.WGMMA_UPCAST_2X, optimized=False)
    if self.ptx:
      halves = nibbles.to_f16_halves(w, nibbles.E2M1_PTX)
    else:
      halves = [plgpu.layout_cast(v, wgmma) for v in quant.e2m1_pair_to_f16(w)]
    return jnp.concatenate([v * scale for v in halves], axis=1).astype(self.compute)

  def step_slot(self, land, slot, interpret: bool):
    data, scales, staging = land
    return GroupSlot(data.at[slot], scales.at[slot], staging, interpret)

  def k_operand(self, slot_ref):
    _, _, plgpu, _ = _mgpu()
    scales = self._k_group_scales(slot_ref.scales, slot_ref.staging, plgpu.commit_smem)
    return self._values(slot_ref.data, scales)

  def prepare_v(self, slot_ref, v_ref, keep_row, commit):
    """V's values into the V buffer (rows of keys the step must not see set to 0, whatever
    bytes the cache holds there)."""
    scales = self._v_group_scales(slot_ref.scales, slot_ref.staging, commit,
                                  slot_ref.interpret)
    x = self._values(slot_ref.data, scales)
    if keep_row is not None:
      rows, lo, hi = keep_row
      x = jnp.where((rows >= lo) & (rows < hi), x, 0).astype(self.compute)
    v_ref[...] = x
    commit()


class GroupSlot(NamedTuple):
  """One side of a step of nvfp4: its data slot ``(T, W)``, scale slot ``(T/8, W)``, the
  side's staging buffer, and whether the kernel runs in interpret mode."""
  data: object
  scales: object
  staging: object
  interpret: bool
