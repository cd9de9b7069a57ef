"""The packed paged KV-cache layout as a static, hashable spec (docs/layout.md §1-§3).

Notation: B = num_blocks, H = num_kv_heads, N = block_size, D = head_size,
C = content dim. The *logical* shape is vLLM's ``(B, H, N, C)``; the *physical*
array (the JAX value that flows) is its permutation by the stride order:
NHD -> ``(B, N, H, C)``, HND -> ``(B, H, N, C)``. Everything format-specific (row widths,
head-size rules, scale views) is the format's codec's answer (:mod:`kvjax.codecs`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import formats as F
from kvjax.codecs.address import ViewGeometry
from kvjax.codecs.nvfp4 import split_strided as nvfp4_split_strided  # noqa: F401 (public name)

LAYOUTS = ("NHD", "HND")
_STRIDE_ORDER = {"NHD": (0, 2, 1, 3), "HND": (0, 1, 2, 3)}
_STRIDE_ORDER_WITH_LAYERS = {"NHD": (1, 0, 3, 2, 4), "HND": (1, 2, 0, 3, 4)}


def check_layout(layout: str) -> str:
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} is not a KV-cache layout; expected one of {LAYOUTS}")
  return layout


def get_kv_cache_stride_order(layout: str = "NHD",
                              include_num_layers_dimension: bool = False) -> Tuple[int, ...]:
  """``stride_order[i]`` = the logical dim stored at physical position i."""
  check_layout(layout)
  table = _STRIDE_ORDER_WITH_LAYERS if include_num_layers_dimension else _STRIDE_ORDER
  return table[layout]


def _check_positive_int(name, value):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


def _check_geometry(fmt: F.CacheFormat, block_size: int, head_size: int, num_kv_heads: int):
  _check_positive_int("num_kv_heads", num_kv_heads)
  _check_positive_int("head_size", head_size)
  _check_positive_int("block_size", block_size)
  if block_size % 16:
    raise ValueError(f"block_size={block_size} must be a multiple of 16")
  fmt.codec.check_head_size(head_size)


def _itemsize(fmt: F.CacheFormat) -> int:
  """Storage itemsize for row widths (plain formats have no scale slot: any value works)."""
  return 1 if fmt.storage is None else fmt.storage.itemsize


def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                       cache_dtype: str = "auto") -> Tuple[int, int, int, int]:
  """vLLM's logical cache shape ``(B, H, N, C)`` (``(B, 2H, N, D/2 + D/16)`` for nvfp4)."""
  fmt = F.get_format(cache_dtype)
  _check_positive_int("num_blocks", num_blocks)
  _check_geometry(fmt, block_size, head_size, num_kv_heads)
  return fmt.codec.logical_shape(num_blocks, num_kv_heads, block_size, head_size, _itemsize(fmt))


def get_mla_kv_cache_shape(num_blocks: int, block_size: int, head_size: int) -> Tuple[int, int, int]:
  """MLA's latent cache: ``(B, N, D_latent)``, 3-D, no head axis (e.g. D_latent = 576)."""
  _check_positive_int("num_blocks", num_blocks)
  _check_positive_int("head_size", head_size)
  _check_positive_int("block_size", block_size)
  if block_size % 16:
    raise ValueError(f"block_size={block_size} must be a multiple of 16")
  return (num_blocks, block_size, head_size)


def contiguous_strides(shape) -> Tuple[int, ...]:
  strides, acc = [], 1
  for n in reversed(shape):
    strides.append(acc)
    acc *= n
  return tuple(reversed(strides))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
  """Static description of one layer's packed paged KV cache.

  Frozen and hashable, and a static pytree node (no leaves): ``jax.jit(kvjax.write_kv)``
  takes it as an ordinary argument, no ``static_argnums`` needed (``static_argnums``
  still works too).

  Attributes:
    num_kv_heads: H, KV heads on this device / tensor-parallel rank.
    head_size: D.
    block_size: N, tokens per page; a multiple of 16.
    cache_dtype: a key of :data:`kvjax.formats.CACHE_FORMATS` ("auto" = the model dtype,
      "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2",
      "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4").
    layout: "NHD" (default) or "HND" (nvfp4: HND only): the order the physical array
      stores a page's tokens and heads in.
    dtype: the model's K/V dtype (bfloat16, float16 or float32), stored as a numpy dtype.

  Derived (properties and methods):
    format: the cache dtype's :class:`kvjax.formats.CacheFormat` (table row); codec: its
      :class:`kvjax.codecs.Codec`.
    storage_dtype / itemsize: numpy dtype / bytes per element of the cache array.
    content_dim: C, the last logical dim: ``2 * padded_head_size`` (K then V), or
      ``D/2 + D/16`` for nvfp4.
    data_dim / padded_head_size: storage elements of data / of data plus scale slot in one
      side row (per-token-head formats: D (D/2 for int4) + 4 bytes of float32 scale).
    head_slots: the logical head axis, H (2H for nvfp4: K heads, then V heads).
    page_bytes: bytes of one page of one layer.
    logical_shape(B) / physical_shape(B): vLLM's ``(B, H, N, C)`` / the array's shape.
    stride_order(): the logical dim at each physical position (NHD ``(0, 2, 1, 3)``, HND
      identity); logical_strides(B): element strides of the logical view.
    kv_view_geometry, scale_view_geometry, nvfp4_split_geometry: vLLM's strided views.
    allocate(B): a new zeroed cache; num_blocks_of(cache): B, after checking the array.

  >>> import jax.numpy as jnp
  >>> spec = KVCacheSpec(num_kv_heads=8, head_size=128, block_size=16)
  >>> spec.logical_shape(100), spec.physical_shape(100), spec.stride_order()
  ((100, 8, 16, 256), (100, 16, 8, 256), (0, 2, 1, 3))
  >>> spec.storage_dtype, spec.content_dim, spec.page_bytes
  (dtype(bfloat16), 256, 65536)
  >>> q8 = KVCacheSpec(8, 128, 16, cache_dtype="int8_per_token_head", layout="HND")
  >>> q8.physical_shape(100), q8.storage_dtype, q8.padded_head_size
  ((100, 8, 16, 264), dtype('int8'), 132)
  """
  num_kv_heads: int
  head_size: int
  block_size: int
  cache_dtype: str = "auto"
  layout: str = "NHD"
  dtype: object = jnp.bfloat16

  def __post_init__(self):
    fmt = F.get_format(self.cache_dtype)
    check_layout(self.layout)
    try:
      dt = np.dtype(self.dtype)
    except TypeError as e:
      raise TypeError(f"dtype={self.dtype!r} is not a dtype") from e
    if dt not in F.MODEL_DTYPES:
      raise TypeError(f"dtype={dt} must be one of {[str(d) for d in F.MODEL_DTYPES]}")
    object.__setattr__(self, "dtype", dt)
    _check_geometry(fmt, self.block_size, self.head_size, self.num_kv_heads)
    if self.layout not in fmt.codec.layouts:
      need = " or ".join(repr(x) for x in fmt.codec.layouts)
      raise ValueError(
          f"{self.cache_dtype} caches need layout={need}, got layout={self.layout!r}"
          + (": each side's [data | scales] split is exact only when the (heads, tokens) "
             "block of a page is contiguous" if fmt.codec.layouts == ("HND",) else ""))

  # -- formats ---------------------------------------------------------------------------
  @property
  def format(self) -> F.CacheFormat:
    """The cache dtype's :class:`kvjax.formats.CacheFormat` (its row of the format table)."""
    return F.get_format(self.cache_dtype)

  @property
  def storage_dtype(self) -> np.dtype:
    """dtype of the cache array."""
    return self.format.storage_dtype(self.dtype)

  @property
  def itemsize(self) -> int:
    """Bytes per element of the cache array (of :attr:`storage_dtype`)."""
    return self.storage_dtype.itemsize

  @property
  def codec(self):
    """The format's :class:`kvjax.codecs.Codec`."""
    return self.format.codec

  @property
  def data_dim(self) -> int:
    """Storage elements of data in one side row (D, or D/2 for int4 and nvfp4)."""
    return self.codec.data_dim(self.head_size)

  @property
  def padded_head_size(self) -> int:
    """Storage elements of one side row, scale slot included (``padded_hs``)."""
    return self.codec.padded_dim(self.head_size, self.itemsize)

  @property
  def num_scales_per_row(self) -> int:
    """NVFP4: e4m3 scales per (head, token) row, S = D/16."""
    return self.head_size // 16

  # -- shapes ----------------------------------------------------------------------------
  def logical_shape(self, num_blocks: int, num_layers: Optional[int] = None) -> Tuple[int, ...]:
    """vLLM's logical shape ``(B, H, N, C)`` (``(B, 2H, N, D/2 + D/16)`` for nvfp4), with a
    leading ``num_layers`` dim when given."""
    shape = get_kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_size,
                               self.cache_dtype)
    return shape if num_layers is None else (_check_positive_int("num_layers", num_layers),) + shape

  def stride_order(self, include_num_layers_dimension: bool = False) -> Tuple[int, ...]:
    """``stride_order[i]`` = the logical dim stored at physical position i: NHD
    ``(0, 2, 1, 3)``, HND ``(0, 1, 2, 3)`` (with the layers dim: ``(1, 0, 3, 2, 4)`` /
    ``(1, 2, 0, 3, 4)``, the layers dim right after the block dim)."""
    return get_kv_cache_stride_order(self.layout, include_num_layers_dimension)

  def physical_shape(self, num_blocks: int, num_layers: Optional[int] = None) -> Tuple[int, ...]:
    """Shape of the contiguous array that holds the cache (the JAX value that flows)."""
    logical = self.logical_shape(num_blocks, num_layers)
    return tuple(logical[i] for i in self.stride_order(num_layers is not None))

  @property
  def content_dim(self) -> int:
    """C, the last dim: K's side row then V's (``2 * padded_head_size``); nvfp4: one side's
    row of ``D/2`` data bytes and ``D/16`` scale bytes."""
    return self.logical_shape(1)[-1]

  @property
  def head_slots(self) -> int:
    """Size of the logical head axis: H, or 2H for nvfp4 (K heads then V heads)."""
    return self.logical_shape(1)[1]

  @property
  def page_bytes(self) -> int:
    """Bytes of one block (page) of one layer."""
    return math.prod(self.logical_shape(1)[1:]) * self.itemsize

  def logical_strides(self, num_blocks: int, num_layers: Optional[int] = None) -> Tuple[int, ...]:
    """Element strides of the logical view over the contiguous physical array."""
    order = self.stride_order(num_layers is not None)
    phys = contiguous_strides(self.physical_shape(num_blocks, num_layers))
    strides = [0] * len(order)
    for pos, dim in enumerate(order):
      strides[dim] = phys[pos]
    return tuple(strides)

  # -- views ---------------------------------------------------------------------------------
  def kv_view_geometry(self, num_blocks: int):
    """(K, V) data views: ``logical.transpose(1, 2)`` split on the last dim.

    Shape ``(B, N, H, padded_hs)`` for per-token-head modes (data in the first
    ``data_dim`` elements), ``(B, N, H, D)`` otherwise; V at offset D (or padded_hs).
    NVFP4 views are per side: see :meth:`nvfp4_split_geometry`.
    """
    if not self.codec.content_halves:
      raise ValueError(f"{self.cache_dtype} K/V are head groups, not content halves: use "
                       "nvfp4_split_geometry")
    s0, s1, s2, s3 = self.logical_strides(num_blocks)
    w = self.padded_head_size
    shape = (num_blocks, self.block_size, self.num_kv_heads, w)
    strides = (s0, s2, s1, s3)
    dt = self.storage_dtype
    return ViewGeometry(shape, strides, 0, dt), ViewGeometry(shape, strides, w, dt)

  def scale_view_geometry(self, num_blocks: int):
    """(K-scale, V-scale) float32 ``(B, N, H)`` views of per-token-head caches."""
    if not self.codec.has_row_scales:
      raise ValueError(f"cache_dtype={self.cache_dtype!r} has no per-token-head scales")
    s0, s1, s2, _ = self.logical_strides(num_blocks)
    ds = self.itemsize
    strides = tuple(s * ds // 4 for s in (s0, s2, s1))
    shape = (num_blocks, self.block_size, self.num_kv_heads)
    f32 = np.dtype(np.float32)
    k_off = self.data_dim * ds // 4
    v_off = (self.padded_head_size + self.data_dim) * ds // 4
    return ViewGeometry(shape, strides, k_off, f32), ViewGeometry(shape, strides, v_off, f32)

  def nvfp4_split_geometry(self, num_blocks: int, side: str):
    """(data, scale) views of one nvfp4 side ("k" or "v").

    data: uint8 ``(B, H, N, D/2)``; scales: e4m3 ``(B, H, N, D/16)``.
    """
    split = getattr(self.codec, "split_geometry", None)
    if split is None:
      raise ValueError(f"cache_dtype={self.cache_dtype!r} is not nvfp4")
    return split(self, num_blocks, side)

  # -- allocation --------------------------------------------------------------------------
  def allocate(self, num_blocks: int, num_layers: Optional[int] = None, *, sharding=None,
               fill=0) -> jax.Array:
    """A new physical cache array filled with ``fill`` (zeros by default).

    Shape :meth:`physical_shape`, dtype :attr:`storage_dtype`. With ``num_layers``, one
    array for all layers, the layers dim right after the block dim (:meth:`stride_order`).
    With ``sharding`` (e.g. ``kvjax.cache_sharding(mesh, spec)``, a ``NamedSharding`` over a
    ``tp`` mesh axis) it is created sharded.

    >>> spec = KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16)
    >>> cache = spec.allocate(8)
    >>> cache.shape, cache.dtype, spec.num_blocks_of(cache)
    ((8, 16, 2, 128), dtype(bfloat16), 8)
    >>> spec.allocate(8, num_layers=4).shape
    (8, 4, 16, 2, 128)
    """
    shape = self.physical_shape(num_blocks, num_layers)
    make = lambda: jnp.full(shape, fill, self.storage_dtype)
    if sharding is None:
      return make()
    return jax.jit(make, out_shardings=sharding)()

  @property
  def layer_axis(self) -> int:
    """Physical position of the layer dim of a layered array: 1 (NHD), 2 (HND)."""
    return self.stride_order(True).index(0)

  def blocks_and_layers(self, cache) -> Tuple[int, Optional[int]]:
    """Validate that ``cache`` is this spec's physical array, one layer's (4-D) or layered
    (5-D, :meth:`physical_shape` with ``num_layers``), and return (B, L); L is None for one
    layer."""
    shape = getattr(cache, "shape", None)
    dtype = getattr(cache, "dtype", None)
    if shape is None or len(shape) not in (4, 5):
      raise ValueError(f"cache must be a 4-D physical cache array (one layer) or a 5-D layered "
                       f"one (all layers), got shape {shape}")
    if np.dtype(dtype) != self.storage_dtype:
      raise TypeError(f"cache dtype {np.dtype(dtype)} is not the spec's storage dtype "
                      f"{self.storage_dtype} (cache_dtype={self.cache_dtype!r})")
    layers = shape[self.layer_axis] if len(shape) == 5 else None
    if layers is not None and self.codec.no_layered_reason:
      raise ValueError(f"cache_dtype={self.cache_dtype!r} has no layered (cross-layer) form: "
                       f"{self.codec.no_layered_reason}; use one 4-D cache per layer")
    expected = self.physical_shape(shape[0], layers)
    if tuple(shape) != expected:
      what = "" if layers is None else f" of {layers} layers"
      raise ValueError(f"cache shape {tuple(shape)} is not the spec's physical shape {expected}"
                       f"{what} (layout={self.layout}, cache_dtype={self.cache_dtype!r})")
    return shape[0], layers

  def num_blocks_of(self, cache) -> int:
    """Validate that ``cache`` is this spec's physical array (one layer) and return B."""
    num_blocks, layers = self.blocks_and_layers(cache)
    if layers is not None:
      raise ValueError(f"cache of shape {tuple(cache.shape)} is a layered (cross-layer) array of "
                       f"{layers} layers, where one layer's 4-D cache is expected: pass the whole "
                       "array with layer= to write_kv / read_kv / unified_attention")
    return num_blocks


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MLACacheSpec:
  """MLA's latent cache: one ``(B, N, D_latent)`` array per layer, model dtype, no heads.

  Frozen, hashable and a static pytree node, like :class:`KVCacheSpec`.

  Attributes:
    latent_dim: D_latent (576 for DeepSeek's compressed KV + rope dims).
    block_size: N, tokens per page; a multiple of 16.
    dtype: the model dtype, stored as a numpy dtype.
  """
  latent_dim: int = 576
  block_size: int = 16
  dtype: object = jnp.bfloat16

  def __post_init__(self):
    get_mla_kv_cache_shape(1, self.block_size, self.latent_dim)
    object.__setattr__(self, "dtype", np.dtype(self.dtype))

  def physical_shape(self, num_blocks: int) -> Tuple[int, int, int]:
    """``(B, N, D_latent)``; the logical shape is the same."""
    return get_mla_kv_cache_shape(num_blocks, self.block_size, self.latent_dim)

  logical_shape = physical_shape

  @property
  def page_bytes(self) -> int:
    """Bytes of one page of one layer."""
    return self.block_size * self.latent_dim * self.dtype.itemsize

  def allocate(self, num_blocks: int, *, fill=0) -> jax.Array:
    """A new ``(B, N, D_latent)`` cache of the model dtype filled with ``fill``."""
    return jnp.full(self.physical_shape(num_blocks), fill, self.dtype)
