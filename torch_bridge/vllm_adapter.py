"""vLLM's attention-backend calling convention over :class:`torch_bridge.PagedAttentionBackend`.

vLLM (v1) drives an attention backend through three objects, and this module provides
each with vLLM's names and signatures:

- :class:`KVJaxAttentionBackend`: static answers (name, cache shape, stride order,
  supported dtypes / block sizes / head sizes) and the classes below;
- :class:`KVJaxAttentionImpl`: one per attention layer, built with vLLM's constructor
  arguments, called as ``do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)``
  then ``forward(layer, query, key, value, kv_cache, attn_metadata, output, ...)``;
- :class:`KVJaxAttentionMetadata` (built by :class:`KVJaxAttentionMetadataBuilder` from
  vLLM's ``CommonAttentionMetadata``): one step's batch, with ``num_actual_tokens``.

The conventions the impl follows:

- per-tensor scales are read from the layer at every call: ``layer._k_scale`` and
  ``layer._v_scale`` (float32 torch tensors; only fp8 per-tensor and nvfp4 caches use
  them), so an in-place update of those tensors is seen by the next call;
- ``attn_metadata is None`` is vLLM's profiling run: ``output`` is returned untouched;
- only the first ``attn_metadata.num_actual_tokens`` rows of ``query`` / ``output`` are
  real; the rows after them are padding and are left untouched in ``output``;
- ``forward`` does not write the cache: vLLM calls ``do_kv_cache_update`` first
  (``KVJaxAttentionBackend.forward_includes_kv_cache_update`` is False);
- the cache layout is the one the backend announces (``kv_cache_layout``, NHD unless a
  subclass says HND); the impl reads it back from the strides of the cache tensor it is
  handed, which is vLLM's logical ``(B, H, N, C)`` view. Block size and model dtype come
  from the tensors too, so one impl serves whatever cache vLLM allocated;
- a layered (cross-layer) cache, vLLM's logical ``(L, B, H, N, C)`` view of one allocation
  for every layer (``get_kv_cache_stride_order(include_num_layers_dimension=True)``), is
  passed whole: the layer index is ``layer_index=``, or else read from ``layer.layer_name``
  (its one integer component, as vLLM numbers layers: "model.layers.3.self_attn.attn" is
  layer 3). A layer's slice ``kv[l]`` is refused (not compact).

Refused with an error naming the argument: ALiBi, non-decoder attention, fused output
quantization (``output_scale`` / ``output_block_scale``), a per-request causal tensor.
"""
from __future__ import annotations

import dataclasses
import enum
import sys
from typing import ClassVar, Optional

import torch

import kvjax
from torch_bridge import dtypes
from torch_bridge.backend import PagedAttentionBackend
from torch_bridge.metadata import PagedAttentionMetadata

DECODER = "decoder"   # vLLM's AttentionType.DECODER (a str enum: compares equal to this)


class MultipleOf:
  """vLLM's "any multiple of ``base``" entry of ``get_supported_kernel_block_sizes``."""

  def __init__(self, base: int):
    self.base = base


def _multiple_of(base: int):
  """vLLM's own ``MultipleOf`` when vLLM has loaded it (its isinstance checks then hold)."""
  vllm_backend = sys.modules.get("vllm.v1.attention.backend")
  return getattr(vllm_backend, "MultipleOf", MultipleOf)(base)


@dataclasses.dataclass(frozen=True)
class KVJaxAttentionMetadata(PagedAttentionMetadata):
  """:class:`PagedAttentionMetadata` plus vLLM's ``num_actual_tokens`` (keyword-only).

  ``num_actual_tokens``: how many leading query rows are real (vLLM pads the token count,
  e.g. to a CUDA-graph size); ``query_start_loc[-1]`` must not exceed it.
  """
  num_actual_tokens: int = dataclasses.field(kw_only=True)

  def __post_init__(self):
    super().__post_init__()
    n = self.num_actual_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
      raise ValueError(f"num_actual_tokens must be a non-negative int, got {n!r}")


class AttentionCGSupport(enum.Enum):
  """vLLM's ``AttentionCGSupport`` levels (vLLM's own enum is used when vLLM is loaded)."""
  ALWAYS = 3
  UNIFORM_BATCH = 2
  UNIFORM_SINGLE_TOKEN_DECODE = 1
  NEVER = 0


def _cg_support(name: str):
  for module in ("vllm.v1.attention.backend", "vllm.v1.attention.backends.utils"):
    enum_cls = getattr(sys.modules.get(module), "AttentionCGSupport", None)
    if enum_cls is not None:
      return enum_cls[name]
  return AttentionCGSupport[name]


def graph_capture_reason(kv_cache_dtype: str, num_heads: int, num_kv_heads: int,
                         head_size: int, block_size: int, dtype=torch.bfloat16,
                         device="cuda") -> Optional[str]:
  """None when a decode step of this configuration (cache write + attention, one query
  token per request) runs as kernels launched on torch's stream, so a CUDA graph captures
  it; else why not."""
  from torch_bridge import mosaic_decode as MDT   # noqa: PLC0415
  from torch_bridge import mosaic_write as MW     # noqa: PLC0415
  if not torch.cuda.is_available():
    return "no CUDA device"
  why = MDT.platform_reason(device)
  if why is not None:
    return why
  try:
    spec = kvjax.KVCacheSpec(num_kv_heads, head_size, block_size, kv_cache_dtype,
                             dtype=dtypes.numpy_dtype(dtype))
  except ValueError as e:
    return str(e)
  return MW.spec_reason(spec) or MDT.spec_reason(spec, dtype, num_heads)


class KVJaxAttentionMetadataBuilder:
  """Builds :class:`KVJaxAttentionMetadata` from vLLM's ``CommonAttentionMetadata``.

  Constructor and ``build`` take vLLM's arguments. The batch is used in any order
  (``reorder_batch_threshold = None``) and cascade attention is never asked for, so
  ``common_prefix_len`` only describes the batch: attention over each whole sequence
  gives the same result.

  CUDA graphs: :meth:`get_cudagraph_support` says UNIFORM_SINGLE_TOKEN_DECODE where
  :func:`graph_capture_reason` finds the decode step launched from torch (a Hopper GPU,
  bf16 / f16 / fp8 per-tensor caches): vLLM then captures pure decode
  steps whole (FULL) and runs other steps' attention eagerly between graph pieces
  (PIECEWISE); elsewhere NEVER.
  """
  reorder_batch_threshold: ClassVar[Optional[int]] = None

  @classmethod
  def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
    """The capture level for this model and cache (vLLM's classmethod)."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    try:
      why = graph_capture_reason(
          getattr(cache, "cache_dtype", "auto"),
          model.get_num_attention_heads(vllm_config.parallel_config),
          kv_cache_spec.num_kv_heads, kv_cache_spec.head_size, kv_cache_spec.block_size,
          kv_cache_spec.dtype if kv_cache_spec.dtype in (torch.bfloat16, torch.float16)
          else model.dtype)
    except AttributeError as e:
      why = f"the configuration does not say ({e})"
    return _cg_support("NEVER" if why else "UNIFORM_SINGLE_TOKEN_DECODE")

  def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
    self.kv_cache_spec = kv_cache_spec
    self.layer_names = layer_names
    self.vllm_config = vllm_config
    self.device = device

  def build(self, common_prefix_len: int, common_attn_metadata,
            fast_build: bool = False) -> KVJaxAttentionMetadata:
    m = common_attn_metadata
    if not isinstance(m.causal, bool):
      raise NotImplementedError(f"causal must be a bool for the whole batch, got "
                                f"{type(m.causal).__name__} (per-request causal flags)")
    return KVJaxAttentionMetadata(
        query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
        block_table=m.block_table_tensor, slot_mapping=m.slot_mapping,
        max_query_len=m.max_query_len, max_seq_len=m.max_seq_len, causal=m.causal,
        num_actual_tokens=m.num_actual_tokens)


class KVJaxAttentionImpl:
  """One attention layer in vLLM's convention, computed by a :class:`PagedAttentionBackend`.

  Args (vLLM's ``AttentionImpl`` constructor):
    num_heads: Hq. head_size: D. scale: softmax scale.
    num_kv_heads: H (None = num_heads).
    alibi_slopes: must be None (ALiBi is not supported).
    sliding_window: window length in tokens, or None.
    kv_cache_dtype: a kvjax cache dtype (vLLM's names: "auto", "fp8", "int8_per_token_head", ...).
    logits_soft_cap: None or 0 (vLLM's "off"), or a positive cap.
    attn_type: "decoder" only.
    kv_sharing_target_layer_name: kept as an attribute, as vLLM's impls keep it.
    sinks: per-query-head sink logits ``[Hq]`` (a torch tensor), or None. Read at the first
      call, after vLLM has loaded the weights into it.
    use_alibi_sqrt: must be False.
  """

  supports_quant_query_input = False    # query always arrives in the model dtype
  can_return_lse_for_decode = False

  def __init__(self, num_heads: int, head_size: int, scale: float,
               num_kv_heads: Optional[int] = None, alibi_slopes=None,
               sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
               logits_soft_cap: Optional[float] = None, attn_type: str = DECODER,
               kv_sharing_target_layer_name: Optional[str] = None,
               sinks: Optional[torch.Tensor] = None, use_alibi_sqrt: bool = False):
    if alibi_slopes is not None or use_alibi_sqrt:
      raise NotImplementedError("alibi_slopes / use_alibi_sqrt: ALiBi is not supported by "
                                "kvjax attention (pass alibi_slopes=None)")
    if attn_type != DECODER:
      raise NotImplementedError(f"attn_type={getattr(attn_type, 'value', attn_type)!r}: only "
                                f"decoder self-attention "
                                f"({DECODER!r}) runs on the paged cache")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    kvjax.get_kv_cache_shape(1, 16, num_kv_heads, head_size, kv_cache_dtype)  # ValueError early
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0 \
        or num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads!r} must be a positive multiple of "
                       f"num_kv_heads={num_kv_heads}")
    self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
    self.scale = float(scale)
    self.sliding_window = sliding_window
    self.kv_cache_dtype = kv_cache_dtype
    self.logits_soft_cap = logits_soft_cap or None    # 0 is vLLM's (flash-attn's) "off"
    self.attn_type = attn_type
    self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
    self.sinks = sinks
    self._backends = {}   # (block size, layout, model dtype) -> PagedAttentionBackend

  def _backend(self, kv_cache, dtype) -> PagedAttentionBackend:
    """The backend for this cache tensor (vLLM's logical view) and model dtype."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.ndim not in (4, 5):
      shape = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else None
      raise ValueError(f"kv_cache must be one layer's 4-D logical cache tensor (B, H, N, C) or "
                       f"a layered 5-D one (L, B, H, N, C), got {type(kv_cache).__name__} of "
                       f"shape {shape}")
    # logical (B, H, N, C): NHD memory holds each token's heads side by side (the N stride is
    # the larger), HND each head's tokens (the H stride is); with one head the bytes agree.
    h = kv_cache.ndim - 3                              # the head dim: 1, or 2 with layers
    layout = "HND" if kv_cache.stride(h) > kv_cache.stride(h + 1) else "NHD"
    key = (kv_cache.shape[h + 1], layout, dtype)
    backend = self._backends.get(key)
    if backend is None:
      backend = self._backends[key] = PagedAttentionBackend(
          self.num_heads, self.num_kv_heads, self.head_size, key[0],
          self.kv_cache_dtype, layout, dtype, scale=self.scale,
          sliding_window=self.sliding_window, soft_cap=self.logits_soft_cap, sinks=self.sinks)
    return backend

  def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                         layer_index: Optional[int] = None) -> None:
    """Write ``key`` / ``value`` ``[T', H, D]`` into ``kv_cache`` in place, by slot.

    ``slot_mapping``: int32/int64 ``[T]``, ``T <= T'`` (the key rows after T are padding
    and not written; a negative slot writes nothing). An empty ``kv_cache`` (vLLM's
    placeholder before the caches are allocated) is left alone. ``layer_index``: the layer
    of a layered ``kv_cache`` (default: from ``layer.layer_name``).
    """
    if isinstance(kv_cache, torch.Tensor) and kv_cache.numel() == 0:
      return
    k_scale, v_scale = _layer_scales(layer)
    self._backend(kv_cache, key.dtype).do_kv_cache_update(
        key, value, kv_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale,
        layer=_layer_index(layer, kv_cache, layer_index))

  def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              kv_cache: torch.Tensor, attn_metadata: Optional[KVJaxAttentionMetadata],
              output: Optional[torch.Tensor] = None, output_scale: Optional[torch.Tensor] = None,
              output_block_scale: Optional[torch.Tensor] = None, *,
              layer_index: Optional[int] = None) -> torch.Tensor:
    """Attention of ``query`` ``[T, Hq, D]`` over ``kv_cache``, written into ``output``.

    ``output``: ``[T, Hq, D]`` or ``[T, Hq*D]`` in the model dtype (required). Rows
    ``[:num_actual_tokens]`` get the result; the others keep their bytes (when there are
    such padding rows, the result passes through a scratch ``[T, ...]`` buffer: one extra
    allocation and copy). ``key`` / ``value`` are not used (the cache was written by
    ``do_kv_cache_update``). ``layer_index``: as in :meth:`do_kv_cache_update`. Returns
    ``output``.
    """
    if output_scale is not None or output_block_scale is not None:
      raise NotImplementedError("output_scale / output_block_scale: fused output quantization "
                                "is not supported (fused_output_quant_supported is False)")
    if output is None:
      raise ValueError("output must be a preallocated tensor (vLLM's accept_output_buffer)")
    if attn_metadata is None:
      return output      # profiling run
    if not isinstance(attn_metadata, KVJaxAttentionMetadata):
      raise TypeError(f"attn_metadata must be a KVJaxAttentionMetadata, got "
                      f"{type(attn_metadata).__name__}")
    n = attn_metadata.num_actual_tokens
    if n > query.shape[0] or n > output.shape[0]:
      raise ValueError(f"num_actual_tokens={n} exceeds the query ({query.shape[0]}) or output "
                       f"({output.shape[0]}) rows")
    if n == 0:
      return output
    k_scale, v_scale = _layer_scales(layer)
    backend = self._backend(kv_cache, query.dtype)
    li = _layer_index(layer, kv_cache, layer_index)
    if n == output.shape[0]:
      backend.forward(query, kv_cache, attn_metadata, output, k_scale=k_scale, v_scale=v_scale,
                      layer=li)
      return output
    # A padded step: attend with every row, so programs are compiled per padded size (vLLM's
    # few CUDA-graph sizes) rather than per actual count; the backend zeroes rows past the
    # last query, so the result goes through a scratch buffer and only real rows are copied.
    full = torch.empty_like(output)
    backend.forward(query, kv_cache, attn_metadata, full, k_scale=k_scale, v_scale=v_scale,
                    layer=li)
    output[:n].copy_(full[:n])
    return output

  def fused_output_quant_supported(self, quant_key) -> bool:
    return False

  def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
    """Nothing to prepare: sinks are read at the first call."""


def _layer_index(layer, kv_cache, layer_index: Optional[int]) -> Optional[int]:
  """The layer index a layered (5-D) ``kv_cache`` is used with; None for a 4-D cache.

  ``layer_index`` when given, else the one integer component of ``layer.layer_name``
  (vLLM's layer naming, e.g. "model.layers.3.self_attn.attn" -> 3)."""
  if kv_cache.ndim != 5:
    return layer_index         # None; anything else is refused by the backend, with the reason
  if layer_index is not None:
    return layer_index
  name = getattr(layer, "layer_name", None)
  numbers = [int(p) for p in name.split(".") if p.isdigit()] if isinstance(name, str) else []
  if len(numbers) != 1:
    raise ValueError(f"kv_cache of shape {tuple(kv_cache.shape)} is a layered (cross-layer) "
                     f"cache: pass layer_index=, or a layer whose layer_name holds its index "
                     f"as its one integer component (got layer_name={name!r})")
  return numbers[0]


def _layer_scales(layer):
  """``(layer._k_scale, layer._v_scale)``: vLLM's per-tensor scales of this layer."""
  try:
    return layer._k_scale, layer._v_scale
  except AttributeError as e:
    raise TypeError(f"layer must carry vLLM's per-tensor scales _k_scale and _v_scale "
                    f"(float32 tensors); {type(layer).__name__} has no {e.name}") from None


class KVJaxAttentionBackend:
  """vLLM's ``AttentionBackend`` static API for kvjax's packed paged cache.

  ``kv_cache_layout`` ("NHD", or "HND" in a subclass) is what
  ``get_kv_cache_stride_order`` and ``get_required_kv_cache_layout`` answer.
  """

  kv_cache_layout: ClassVar[str] = "NHD"
  accept_output_buffer: ClassVar[bool] = True
  forward_includes_kv_cache_update: ClassVar[bool] = False
  supported_dtypes: ClassVar[list] = [torch.float16, torch.bfloat16, torch.float32]
  supported_kv_cache_dtypes: ClassVar[list] = list(kvjax.CACHE_FORMATS)

  @staticmethod
  def get_name() -> str:
    return "KVJAX"

  @staticmethod
  def get_impl_cls() -> type:
    return KVJaxAttentionImpl

  @staticmethod
  def get_builder_cls() -> type:
    return KVJaxAttentionMetadataBuilder

  @staticmethod
  def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                         cache_dtype_str: str = "auto") -> tuple:
    """Logical ``(B, H, N, C)`` (``(B, 2H, N, D/2 + D/16)`` for nvfp4); ValueError if refused."""
    return kvjax.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                                    cache_dtype_str)

  @classmethod
  def get_kv_cache_stride_order(cls, include_num_layers_dimension: bool = False) -> tuple:
    """Logical dim stored at each physical position, for ``kv_cache_layout``."""
    return kvjax.get_kv_cache_stride_order(cls.kv_cache_layout, include_num_layers_dimension)

  @classmethod
  def get_required_kv_cache_layout(cls) -> str:
    return cls.kv_cache_layout

  @staticmethod
  def get_supported_kernel_block_sizes() -> list:
    """Any multiple of 16, in one kernel block (a test checks it against kvjax's rule)."""
    return [_multiple_of(16)]

  @classmethod
  def supports_block_size(cls, block_size: Optional[int]) -> bool:
    return block_size is None or _accepted(block_size=block_size)

  @classmethod
  def get_supported_head_sizes(cls) -> list:
    """Empty: vLLM's "any head size" (cache dtypes add their own rules, see get_kv_cache_shape)."""
    return []

  @classmethod
  def supports_head_size(cls, head_size: int) -> bool:
    return _accepted(head_size=head_size)

  @classmethod
  def supports_dtype(cls, dtype: torch.dtype) -> bool:
    return dtype in cls.supported_dtypes

  @classmethod
  def supports_kv_cache_dtype(cls, kv_cache_dtype: Optional[str]) -> bool:
    return kv_cache_dtype is None or kv_cache_dtype in cls.supported_kv_cache_dtypes

  @classmethod
  def supports_attn_type(cls, attn_type: str) -> bool:
    return attn_type == DECODER

  @classmethod
  def supports_sink(cls) -> bool:
    return True


def _accepted(block_size: int = 16, head_size: int = 16) -> bool:
  """Whether kvjax takes this geometry for a plain cache (its rules, asked, not restated)."""
  try:
    kvjax.get_kv_cache_shape(1, block_size, 1, head_size)
  except ValueError:
    return False
  return True
