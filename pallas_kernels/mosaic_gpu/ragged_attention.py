"""Mosaic GPU (Hopper) ragged paged attention over the packed cache (docs/layout.md §6).

Entry point :func:`ragged_paged_attention`, with the semantics of
:func:`kvjax.reference.unified_attention`: prefills with a cached prefix and decodes in one
ragged batch, GQA of any ratio up to 16 (8 at head size 256), causal, sliding window, soft
cap, per-head sinks; padding tokens and rows with no visible key give 0.
:func:`supports_attention` says when it applies (None) or why not (a one-line reason). The
kernel body and its pipeline are in
:mod:`pallas_kernels.mosaic_gpu.kernel`, the tiling in :mod:`pallas_kernels.mosaic_gpu.tiles`.

Static sizes: ``H * (cdiv(T, bq) + S + 1)`` work items (KV head x query tile) with ``bq``
from the max_query_len bucket (a power of two), walked by one persistent block per SM, so one
compiled kernel serves every step with the same ``(T, S, max_blocks)`` and bucket; surplus
items cost a block a few scalar loads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import plain_copy as PC
from kvjax.spec import KVCacheSpec
from pallas_kernels import ragged_schedule as sched
from pallas_kernels.common import static_or_none
from pallas_kernels.mosaic_gpu import tiles as TL
from pallas_kernels.mosaic_gpu import tuning as MT
from pallas_kernels.mosaic_gpu.adapters import ADAPTERS
from pallas_kernels.mosaic_gpu.compat import JAX_VERSION
from pallas_kernels.mosaic_gpu.kernel_statics import landing_bytes

SUPPORTED_HEAD_SIZES = (64, 128, 256)
SUPPORTED_Q_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
MIN_JAX = (0, 11)
#: How the kernel reads a quantized cache: through a plain copy of the batch's pages
#: (:mod:`kvjax.plain_copy`), or as stored, its producer converting each step
#: (:mod:`.ragged_landing`, formats whose hooks say ``ragged_direct``).
READS = ("copy", "direct")


def _gpu_reason() -> str | None:
  """None when the default backend is an sm90+ NVIDIA GPU, else why not."""
  try:
    dev = jax.devices()[0]
  except RuntimeError as e:   # no backend at all
    return f"no JAX device: {e}"
  if dev.platform != "gpu":
    return f"needs an NVIDIA GPU (sm90+); the default device is {dev.platform}"
  cc = getattr(dev, "compute_capability", None)
  try:
    major = int(str(cc).split(".")[0])
  except ValueError:
    return f"cannot read the GPU's compute capability ({cc!r})"
  if major < 9:
    return f"needs sm90+ (wgmma, TMA); this GPU is sm{str(cc).replace('.', '')}"
  return None


def spec_reason(spec: KVCacheSpec, q_dtype, group: int | None = None) -> str | None:
  """Why the kernel cannot take this spec / q dtype / GQA group (None: it can). Device-free.

  The kernel reads plain 16-bit caches in q's dtype; every other format (quantized, scaled)
  through a plain copy of the batch's pages in q's dtype (:mod:`kvjax.plain_copy`) or, where
  :func:`direct_reason` allows, as stored (``read="direct"``)."""
  if not isinstance(spec, KVCacheSpec):
    return f"spec must be a kvjax.KVCacheSpec, got {type(spec).__name__}"
  if np.dtype(q_dtype) not in SUPPORTED_Q_DTYPES:
    return f"q dtype {np.dtype(q_dtype)}: the kernel takes bfloat16/float16"
  plain = PC.is_plain(spec)
  if plain and np.dtype(spec.storage_dtype) not in SUPPORTED_Q_DTYPES:
    return f"cache storage {np.dtype(spec.storage_dtype)}: the kernel takes bfloat16/float16"
  if plain and np.dtype(q_dtype) != np.dtype(spec.storage_dtype):
    return f"q dtype {np.dtype(q_dtype)} differs from the cache's {np.dtype(spec.storage_dtype)}"
  if spec.head_size not in SUPPORTED_HEAD_SIZES:
    return f"head_size={spec.head_size}: the kernel takes {SUPPORTED_HEAD_SIZES}"
  if group is not None and not 1 <= group <= TL.max_group(spec.head_size):
    return (f"GQA group {group}: the kernel packs at most {TL.max_group(spec.head_size)} query "
            f"heads per KV head at head size {spec.head_size}")
  return None


def direct_reason(spec: KVCacheSpec, q_dtype) -> str | None:
  """None when the kernel can read ``spec``'s quantized pages as stored (``read="direct"``),
  else why not. Device-free."""
  if PC.is_plain(spec):
    return "the cache is plain: the kernel reads it as stored anyway"
  hooks = ADAPTERS.hooks(spec.codec)
  if hooks is None or not hooks.ragged_direct:
    return f"cache_dtype={spec.cache_dtype!r} is read through a plain copy of its pages"
  return hooks.reason(spec, q_dtype)


def _direct_operands(spec: KVCacheSpec, q_dtype, read):
  """The format hooks when the kernel reads ``spec``'s pages as stored, else None (a plain
  cache, or ``read`` "copy"); ``read`` None: :data:`.tuning.RAGGED_DIRECT`'s choice."""
  if PC.is_plain(spec):
    return None
  if read is None:
    read = "direct" if spec.cache_dtype in MT.RAGGED_DIRECT else "copy"
  if read not in READS:
    raise ValueError(f"read must be one of {READS} or None, got {read!r}")
  if read == "copy":
    return None
  why = direct_reason(spec, q_dtype)
  if why is not None:
    raise ValueError(f"read='direct': {why}")
  return ADAPTERS.hooks(spec.codec).of(spec, q_dtype)


def supports_attention(spec, q_dtype) -> str | None:
  """None when :func:`ragged_paged_attention` runs here for ``spec`` and ``q_dtype``, else a
  one-line reason (jax older than 0.11, no sm90+ GPU, cache format, dtype, head size)."""
  return spec_reason(spec, q_dtype) or platform_reason()


def platform_reason() -> str | None:
  """None when the Mosaic GPU kernels run compiled in this process (jax >= 0.11 and an sm90+
  default device), else a one-line reason."""
  if JAX_VERSION < MIN_JAX:
    return f"jax {jax.__version__}: the Mosaic GPU kernel needs jax >= 0.11"
  return _gpu_reason()




def prefer_attention(spec, q_dtype, call) -> str | None:
  """The auto rule (registry ``prefer``): None when ``auto`` should take this kernel.

  Yes for a batch with a static ``max_query_len >= tuning.AUTO_MIN_QUERY_LEN`` and a GQA group
  the kernel packs; on a quantized cache it reads through a plain copy only where the copy
  pays (:func:`kvjax.plain_copy.worth_a_plain_copy`)."""
  if call is None or call.max_query_len is None:
    return ("auto takes it only for a static max_query_len >= "
            f"{MT.AUTO_MIN_QUERY_LEN} (the call gives none)")
  if call.max_query_len < MT.AUTO_MIN_QUERY_LEN:
    return (f"max_query_len={call.max_query_len} < {MT.AUTO_MIN_QUERY_LEN}: the Triton "
            "kernels are faster there (measured)")
  reason = spec_reason(spec, q_dtype, call.num_q_heads // spec.num_kv_heads)
  if reason is not None:
    return reason
  direct = spec.cache_dtype in MT.RAGGED_DIRECT and direct_reason(spec, q_dtype) is None
  if not PC.is_plain(spec) and not direct and not PC.worth_a_plain_copy(
      spec, q_dtype, call.num_tokens, call.num_seqs, call.max_blocks):
    return (f"cache_dtype={spec.cache_dtype!r}: too few query tokens for a plain copy of the "
            "pages to pay")
  return None


def ragged_paged_attention(q, cache, spec: KVCacheSpec, *, query_start_loc, seq_lens,
                           block_table, scale, causal=True, sliding_window=None, soft_cap=None,
                           sinks=None, k_scale=None, v_scale=None, max_query_len=None,
                           interpret=False, pv=None, model_frame=False, read=None):
  """Ragged paged attention; arguments as :func:`kvjax.reference.unified_attention`.

  Args:
    q: ``[T, Hq, D]`` bf16/f16 (the cache's dtype), Hq = G * H with G <= 16 (8 at D = 256).
    cache: the spec's physical cache (NHD ``(B, N, H, 2D)`` or HND ``(B, H, N, 2D)``).
    query_start_loc: int32 ``[S+1]``; seq_lens: int32 ``[S]``; block_table: int32
      ``[S, max_blocks]``.
    scale: softmax scale (a float or a traced scalar). causal, sliding_window, soft_cap:
      static.
    sinks: float32 ``[Hq]`` per-query-head sink logits or None.
    k_scale, v_scale: global scales of a quantized cache.
    max_query_len: static bound on every sequence's query length (None = T); its power-of-two
      bucket sets the tile's token count.
    interpret: run in Mosaic GPU interpret mode on CPU (jax >= 0.11; slow, small shapes).
    pv: how the kernel issues ``acc += P V``, one of ``tiles.PV_VARIANTS`` (None:
      ``tiles.default_pv(interpret)``; interpret mode runs only "p_smem_fresh").
    model_frame: False: q is in the frame the cache stores (a rotated format's q already
      rotated, as :func:`kvjax.unified_attention` passes it to other implementations) and so
      is the output. True: q and the output are in the model's frame; the kernel applies the
      format's rotation (``spec.codec.rotation``) to each q tile and un-rotates each output
      tile itself where its matrix fits in shared memory (head sizes 64 and 128), else the
      rotation's own ops run around it. ``scale`` is the rotated frame's either way.
    read: how a quantized cache is read, one of :data:`READS` (None: the measured choice,
      :data:`.tuning.RAGGED_DIRECT`); the output is the same either way.
  Returns:
    ``[T, Hq, D]`` in q's dtype; padding tokens and rows with no visible key are 0.
  """
  return ragged_paged_attention_tiled(
      q, cache, spec, query_start_loc=query_start_loc, seq_lens=seq_lens,
      block_table=block_table, scale=scale, causal=causal, sliding_window=sliding_window,
      soft_cap=soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
      max_query_len=max_query_len, interpret=interpret, pv=pv, model_frame=model_frame,
      read=read)


def ragged_paged_attention_tiled(q, cache, spec: KVCacheSpec, *, query_start_loc, seq_lens,
                                 block_table, scale, causal=True, sliding_window=None,
                                 soft_cap=None, sinks=None, k_scale=None, v_scale=None,
                                 max_query_len=None, interpret=False, pv=None,
                                 geometry: TL.TileGeometry | None = None,
                                 ping_pong: bool = True, num_programs: int | None = None,
                                 staging: str | None = None,
                                 registers: tuple[int, int] | None = None,
                                 model_frame: bool = False, read: str | None = None):
  """:func:`ragged_paged_attention` with the tile geometry chosen by the caller (None: by
  :func:`tiles.choose_geometry`), the ping-pong schedule of two consumer warpgroups
  switchable (``kernel.py``), the number of CUDA blocks (None: :func:`.tuning.num_programs`;
  0: one per work item), how q and the output pass through shared memory (None:
  :func:`tiles.choose_staging`; one of ``tiles.STAGINGS``) and the (consumer, producer)
  registers a thread (None: ``kernel.default_registers``), for benchmark sweeps; ``read`` as
  :func:`ragged_paged_attention`'s."""
  from pallas_kernels.mosaic_gpu import kernel as K   # imports Mosaic GPU only when used
  t, hq, d = q.shape
  if d != spec.head_size:
    raise ValueError(f"q head size {d} is not the spec's head_size {spec.head_size}")
  _checked(spec, q.dtype, hq, pv, interpret)
  num_seqs = seq_lens.shape[0]
  if t == 0 or num_seqs == 0:
    return jnp.zeros(q.shape, q.dtype)
  rotation = spec.codec.rotation
  products = rotation.products(d) if model_frame else None
  around = products is not None and not _rotation_fits(
      spec, q.dtype, hq, t, max_query_len, pv, interpret, geometry)
  if around:                           # the rotation's ops around the kernel
    q, products = rotation.rotate_q(q), None
  ops = _direct_operands(spec, q.dtype, read)
  tensor_scales = None
  if ops is not None:                  # read as stored, converted in the kernel
    tensor_scales = spec.codec.tensor_scales(k_scale, v_scale, spec.num_kv_heads)
  elif not PC.is_plain(spec):          # read through a plain copy in q's dtype
    cache, spec, block_table = PC.plain_pages(cache, spec, block_table, k_scale, v_scale,
                                              dtype=q.dtype)
  max_blocks = block_table.shape[1]
  st = ragged_statics(
      spec, q.dtype, t, hq, num_seqs, max_blocks, spec.num_blocks_of(cache),
      scale=static_or_none(scale), causal=causal, sliding_window=sliding_window,
      soft_cap=soft_cap, sinks=sinks is not None, max_query_len=max_query_len,
      interpret=interpret, pv=pv, geometry=geometry, ping_pong=ping_pong,
      num_programs=MT.num_programs(interpret) if num_programs is None else int(num_programs),
      staging=staging, registers=registers,
      out_factor=None if products is None else products[1], ops=ops)
  meta = TL.tile_metadata(query_start_loc, seq_lens, max_blocks, t, st.num_tiles, st.geo.bq)
  sk = (jnp.zeros((hq,), jnp.float32) if sinks is None
        else jnp.asarray(sinks, jnp.float32).reshape(hq))
  traced_scale = None if st.scale is not None else jnp.asarray(scale, jnp.float32).reshape(1)
  rt = None if products is None else jnp.asarray(products[0], q.dtype)
  out = K.ragged_attention_call(meta, block_table.astype(jnp.int32).reshape(-1), sk,
                                traced_scale, q, cache, st=st, rt=rt,
                                tensor_scales=tensor_scales)
  return rotation.unrotate_out(out) if around else out


def _rotation_fits(spec: KVCacheSpec, q_dtype, num_heads: int, num_tokens: int,
                   max_query_len, pv, interpret, geometry) -> bool:
  """Whether the kernel has shared memory for the rotation's ``(D, D)`` matrix next to the
  tile's buffers (with the fewest K/V slots and q staged with the output)."""
  group, pv = _checked(spec, q_dtype, num_heads, pv, interpret)
  mql = _bucket(num_tokens, max_query_len)
  d, itemsize = spec.head_size, np.dtype(q_dtype).itemsize
  geo = geometry or TL.choose_geometry(group, d, spec.block_size, mql, itemsize, pv,
                                       rotation=True)
  return geo.smem_bytes(d, itemsize, pv, rotation=True) <= TL.SMEM_BUDGET


def _bucket(num_tokens: int, max_query_len) -> int:
  """The power-of-two max_query_len bucket that sets the tile's token count."""
  mql = num_tokens if max_query_len is None else int(max_query_len)
  if mql <= 0:
    raise ValueError(f"max_query_len must be a positive int or None, got {max_query_len!r}")
  return min(sched.next_pow2(mql), sched.next_pow2(max(num_tokens, 1)))


def ragged_statics(spec: KVCacheSpec, q_dtype, num_tokens: int, num_heads: int,
                   num_seqs: int, max_blocks: int, num_blocks: int, *, scale=None,
                   causal=True, sliding_window=None, soft_cap=None, sinks: bool = False,
                   max_query_len=None, interpret=False, pv=None,
                   geometry: TL.TileGeometry | None = None, ping_pong: bool = True,
                   num_programs: int = 0, staging: str | None = None, registers=None,
                   out_factor: float | None = None, ops=None):
  """The ragged kernel's statics (:class:`.kernel_statics.KernelStatics`) for one call
  shape: T tokens of Hq heads in S sequences over a plain cache of B blocks, block tables
  of width M; ``scale`` a float (None: the kernel reads it from an operand), the tile from
  ``max_query_len``'s power-of-two bucket (None: T); ``out_factor``: the kernel rotates q and
  un-rotates its output (:meth:`kvjax.rotation.Rotation.products`); ``ops``: the format's
  hooks when the kernel reads the cache as stored (:func:`_direct_operands`), else None (a
  plain cache). Raises ValueError naming what the kernel cannot take."""
  from pallas_kernels.mosaic_gpu import kernel as K   # imports Mosaic GPU only when used
  h, d = spec.num_kv_heads, spec.head_size
  group, pv = _checked(spec, q_dtype, num_heads, pv, interpret)
  mql = _bucket(num_tokens, max_query_len)
  itemsize = np.dtype(q_dtype).itemsize
  rotation = out_factor is not None
  landing = landing_bytes(ops, d)
  geo = geometry or TL.choose_geometry(group, d, spec.block_size, mql, itemsize, pv,
                                       rotation=rotation, landing=landing)
  if staging is None:
    staging = TL.choose_staging(geo, d, itemsize, pv, interpret, rotation=rotation,
                                landing=landing)
  if geo.group != group or geo.block_size != spec.block_size:
    raise ValueError(f"geometry {geo} does not match group {group} / block size "
                     f"{spec.block_size}")
  need = geo.smem_bytes(d, itemsize, pv, staging, rotation, landing)
  if need > TL.SMEM_BUDGET:
    raise ValueError(f"geometry {geo} needs {need} bytes of shared memory with pv={pv!r}, "
                     f"staging={staging!r}, rotation={rotation}, landing={landing}; the "
                     f"budget is {TL.SMEM_BUDGET}")
  # q and out move through untiled shared memory: a tile may start at any token, T need not
  # be a multiple of 8 (the kernel's q boxes past T read zeros, its stores stop at T).
  return K.KernelStatics(
      geo=geo, head_size=d, num_kv_heads=h, layout=spec.layout, num_blocks=num_blocks,
      max_blocks=max_blocks, num_tiles=TL.num_tiles_bound(num_tokens, num_seqs, geo.bq),
      causal=bool(causal), window=None if sliding_window is None else int(sliding_window),
      soft_cap=None if soft_cap is None else float(soft_cap), has_sinks=bool(sinks),
      scale=scale, dtype=np.dtype(q_dtype), interpret=bool(interpret), pv=pv,
      ping_pong=bool(ping_pong), num_programs=int(num_programs), staging=staging,
      registers=None if registers is None else tuple(registers),
      out_factor=None if out_factor is None else float(out_factor), ops=ops)


def _checked(spec: KVCacheSpec, q_dtype, num_heads: int, pv, interpret):
  """(GQA group, pv variant) of a call, or ValueError naming what the kernel cannot take."""
  h = spec.num_kv_heads
  if num_heads % h:
    raise ValueError(f"q has {num_heads} heads, not a multiple of num_kv_heads={h}")
  pv = TL.default_pv(interpret) if pv is None else pv
  if pv not in TL.PV_VARIANTS:
    raise ValueError(f"pv must be one of {TL.PV_VARIANTS} or None, got {pv!r}")
  reason = spec_reason(spec, q_dtype, num_heads // h)
  if reason is not None:
    raise ValueError(f"Mosaic GPU ragged attention: {reason}")
  return num_heads // h, pv
