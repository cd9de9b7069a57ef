"""The randomized Hadamard transform (RHT) that vLLM applies around its int4 per-token-head cache.

vLLM 0.28 rotates every K and V row before int4 quantization, and rotates the queries (and
un-rotates the output) in attention, so that outliers are spread over the whole head:

  forward:  ``rht(x)         = H_D (x * signs)``
  inverse:  ``rht(y, True)   = (H_D y) * signs``      (``rht(rht(x), True) == D * x``)

``H_D`` is the unnormalized Walsh–Hadamard matrix of Sylvester order (``H_1 = [1]``,
``H_2n = [[H_n, H_n], [H_n, -H_n]]``), computed here with the log2(D) butterfly stages in
float32, and ``signs`` a fixed ±1 vector. The signs are vLLM's: the first D draws of
``2 * bernoulli(0.5) - 1`` from a CPU ``torch.Generator`` seeded ``0x9E3779B9``. That
sequence is prefix-consistent (the signs of D are the first D signs of 2D), so one
constant of 1024 sign bits serves every power-of-two head size up to 1024;
``tests/test_rotation.py`` re-derives it with torch when torch is installed.

A cache format stores its values in the frame of a :class:`Rotation` of the head dim (its
codec's ``rotation``): :data:`NO_ROTATION` for every format but int4 per token-head, which
uses :data:`HADAMARD`. The public ops apply it once, around every registered implementation
(``kvjax.write_kv`` rotates K and V; ``kvjax.unified_attention`` rotates q, divides the softmax
scale by D and un-rotates the output; ``kvjax.read_kv`` and ``kvjax.dequantize_pages``
un-rotate what they read), so kernels and references compute on the stored values only.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

#: Bit i set = sign i is -1, for i < 1024 (vLLM's RHT signs, see the module docstring).
_SIGN_BITS_1024 = int(
    "f6680674bb9454f056a40da04bee5a90c78728fd237771ac1e32d587b2e4cf051d541dfe0f3cfceba50d373fe2"
    "9e73330ca36fb4eb0082b6d9cf73a9668ae4e375625346365fdb8932d9dff1cfc7869167fc4ca6e46ae22557"
    "563834b291e3cc05dfbc5fcdf467b754503bbeb55b747e9480abc759bbc2937f7fca4e9a8ca6f2", 16)
MAX_HEAD_SIZE = 1024


def check_head_size(head_size: int) -> int:
  """``head_size`` if the RHT is defined for it (a power of two in [2, 1024]), else ValueError."""
  d = int(head_size)
  if d < 2 or d > MAX_HEAD_SIZE or d & (d - 1):
    raise ValueError(f"head_size={head_size}: the Hadamard rotation needs a power of two in "
                     f"[2, {MAX_HEAD_SIZE}]")
  return d


@functools.lru_cache(maxsize=None)
def rht_signs(head_size: int) -> np.ndarray:
  """vLLM's ±1 RHT signs for ``head_size``, float32 ``[D]``."""
  d = check_head_size(head_size)
  bits = (_SIGN_BITS_1024 >> np.arange(d, dtype=object)) & 1
  return np.where(bits.astype(bool), -1.0, 1.0).astype(np.float32)


def hadamard(x):
  """Unnormalized Walsh–Hadamard transform of the last axis (Sylvester order), float32.

  ``x [..., D]`` with D a power of two -> float32 ``[..., D]``, exactly ``x @ H_D`` computed
  as log2(D) butterfly stages (each ``(a, b) -> (a + b, a - b)`` on halves of size h).
  """
  x = jnp.asarray(x, jnp.float32)
  d = check_head_size(x.shape[-1])
  lead = x.shape[:-1]
  h = 1
  while h < d:
    v = x.reshape(lead + (d // (2 * h), 2, h))
    a, b = v[..., 0, :], v[..., 1, :]
    x = jnp.stack([a + b, a - b], axis=-2).reshape(lead + (d,))
    h *= 2
  return x


def rht(x, inverse: bool = False):
  """The RHT of the last axis in float32: ``H(x * signs)``, or ``H(x) * signs`` if ``inverse``.

  ``x [..., D]`` any float dtype -> float32 ``[..., D]``. Unnormalized: applying the forward
  and then the inverse transform multiplies by D.

  >>> import numpy as np
  >>> x = np.arange(8, dtype=np.float32)
  >>> np.asarray(rht(rht(x), inverse=True) / 8).tolist()
  [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
  """
  x = jnp.asarray(x, jnp.float32)
  signs = jnp.asarray(rht_signs(x.shape[-1]))
  if inverse:
    return hadamard(x) * signs
  return hadamard(x * signs)


@functools.lru_cache(maxsize=None)
def rht_matrix(head_size: int, inverse: bool = False) -> np.ndarray:
  """``M`` float32 ``[D, D]`` with ``x @ M == rht(x, inverse)`` (entries ±1)."""
  d = check_head_size(head_size)
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  signs = rht_signs(d)
  return signs[:, None] * h if not inverse else h * signs[None, :]


def _times_matrix(x, m: np.ndarray, post_scale: float = 1.0):
  """``(x [..., D] @ m) * post_scale`` accumulated in float32, in x's dtype (16-bit x: a
  16-bit product, exact for a ±1 ``m``; float32 x: at full float32 precision)."""
  sixteen = np.dtype(x.dtype).itemsize == 2
  out = jax.lax.dot_general(x, jnp.asarray(m, x.dtype if sixteen else jnp.float32),
                            (((x.ndim - 1,), (0,)), ((), ())),
                            precision=None if sixteen else jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
  return (out * np.float32(post_scale) if post_scale != 1.0 else out).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Rotation:
  """The identity (base class): the cache stores K and V as the model gives them.

  A subclass is a linear map ``R`` of the head dim with ``R^T R = c * I``; it says how the
  public ops move values into and out of the stored frame:

  - :meth:`rotate`: K, V (before a write) and q (before attention) -> the stored frame;
  - :meth:`softmax_scale`: the scale of ``q' . k'`` that gives the scale of ``q . k``;
  - :meth:`unrotate`: attention outputs and read values -> the model's frame.
  """

  def rotate(self, x):
    """``x [..., D]`` -> ``R x`` in ``x``'s dtype."""
    return x

  def unrotate(self, y):
    """``y [..., D]`` -> ``R^-1 y`` in ``y``'s dtype."""
    return y

  def softmax_scale(self, scale, head_size: int):
    """The softmax scale to use on rotated q and k (a Python float stays one)."""
    del head_size
    return scale

  def rotate_q(self, q):
    """:meth:`rotate` for attention's queries, where tolerances, not stored bytes, matter
    (a subclass may compute it in another order)."""
    return self.rotate(q)

  def unrotate_out(self, y):
    """:meth:`unrotate` for attention's outputs (as :meth:`rotate_q`)."""
    return self.unrotate(y)

  def products(self, head_size: int):
    """What a kernel needs to apply :meth:`rotate_q` and :meth:`unrotate_out` itself, as
    matrix products: ``(rt, factor)`` with ``rotate_q(q) == dtype(q @ rt.T)`` and
    ``unrotate_out(y) == dtype((y @ rt) * factor)``, ``rt`` float32 ``[D, D]`` of entries exact
    in 16 bits, products accumulated in float32; None for the identity (nothing to apply)."""
    del head_size
    return None


@dataclasses.dataclass(frozen=True)
class HadamardRotation(Rotation):
  """vLLM's int4 rotation: ``rht`` in float32, rounded to the dtype it was given.

  ``rotate(x) = dtype(H (x * signs))`` (the rotated row is rounded to the model dtype
  before it is quantized, as vLLM does); since ``rht(x) . rht(y) = D x . y``, attention on
  rotated q and k uses ``scale / D``, and ``unrotate(y) = dtype(H (y / D) * signs)`` (the
  division by the power of two D is exact, so this is vLLM's ``H(y) * signs / D``).
  """

  def rotate(self, x):
    return rht(x).astype(x.dtype)

  def unrotate(self, y):
    inv_d = np.float32(1.0 / y.shape[-1])
    return rht(jnp.asarray(y, jnp.float32) * inv_d, inverse=True).astype(y.dtype)

  def softmax_scale(self, scale, head_size: int):
    return scale / head_size

  def rotate_q(self, q):
    """``rotate`` as one product with the ±1 matrix of the transform (its entries and every
    product with a 16-bit q are exact; the float32 sum runs in the tensor cores' order, not
    the butterflies'): one pass over ``[T, Hq, D]`` instead of log2(D)."""
    rt, _ = self.products(q.shape[-1])
    return _times_matrix(q, rt.T)

  def unrotate_out(self, y):
    """``unrotate`` as one product (as :meth:`rotate_q`), divided by D in float32 after it
    (exact: a power of two)."""
    rt, factor = self.products(y.shape[-1])
    return _times_matrix(y, rt, factor)

  def products(self, head_size: int):
    """``(rht_matrix(D, inverse=True), 1 / D)``: the inverse transform's ±1 matrix is the
    forward one's transpose."""
    return rht_matrix(head_size, inverse=True), 1.0 / head_size


NO_ROTATION = Rotation()
HADAMARD = HadamardRotation()
