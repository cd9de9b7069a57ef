"""vLLM 0.28's Triton attention kernels and cache writers, run on kvjax's own cache buffers.

For side-by-side benchmarks and interop checks on a CUDA machine. vLLM's kernels are not part
of kvjax: they are loaded from a folder built from vLLM's wheel (vLLM's own
``triton_unified_attention.py``, ``triton_reshape_and_cache_flash.py`` and
``int4_per_token_head.py`` behind small stand-ins for the modules they import), found through
``$KVJAX_VLLM_KERNELS`` or ``<repo>/.vllm_anchor``. :func:`available` says whether it is there.

The cache crosses zero-copy (``torch_bridge.to_torch``), so vLLM reads and writes the very
bytes kvjax reads and writes. K/V are vLLM's ``(B, N, H, W)`` views, per-token-head scales its
``(B, N, H)`` float32 views.
"""
from __future__ import annotations

import functools
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: kvjax format kind name -> vLLM KVQuantMode member name.
_QUANT_MODE = {
    "auto": "NONE", "bfloat16": "NONE", "float16": "NONE", "float32": "NONE",
    "fp8": "FP8_PER_TENSOR", "fp8_e4m3": "FP8_PER_TENSOR", "fp8_e5m2": "FP8_PER_TENSOR",
    "int8_per_token_head": "INT8_PER_TOKEN_HEAD", "fp8_per_token_head": "FP8_PER_TOKEN_HEAD",
    "int4_per_token_head": "INT4_PER_TOKEN_HEAD",
}
#: Softmax segments of vLLM's split-KV ("3D") decode path (its default).
NUM_SEGMENTS = 16


def kernels_dir() -> str:
  return os.environ.get("KVJAX_VLLM_KERNELS", os.path.join(_REPO, ".vllm_anchor"))


@functools.lru_cache(maxsize=None)
def _modules():
  path = kernels_dir()
  if not os.path.isdir(os.path.join(path, "vllm")):
    return None
  if path not in sys.path:
    sys.path.insert(0, path)
  try:
    from vllm.v1.attention.ops import triton_reshape_and_cache_flash as writer
    from vllm.v1.attention.ops import triton_unified_attention as attn
    from vllm.v1.kv_cache_interface import KVQuantMode
  except Exception as e:  # noqa: BLE001 - report why vLLM's kernels are absent, run without them
    print(f"[vllm_peer] vLLM kernels not importable from {path}: {e!r}")
    return None
  return attn, writer, KVQuantMode


@functools.lru_cache(maxsize=None)
def _int4_module():
  """vLLM's ``int4_per_token_head`` module (its rotation and int4 write kernel), or None."""
  if _modules() is None:
    return None
  from vllm.v1.attention.ops import int4_per_token_head
  return int4_per_token_head


def available() -> bool:
  """True on a CUDA machine where vLLM's kernels import."""
  try:
    import torch
  except ImportError:
    return False
  return torch.cuda.is_available() and _modules() is not None


def supports(spec) -> bool:
  return spec.cache_dtype in _QUANT_MODE


def _views(cache_t, spec):
  """vLLM's (key_cache, value_cache, k_scale_cache, v_scale_cache) of a logical torch cache."""
  import torch
  import torch_bridge as tb
  k, v = tb.kv_views(cache_t, spec)
  ks = vs = None
  if spec.cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
    fp8 = torch.float8_e5m2 if spec.cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    k, v = k.view(fp8), v.view(fp8)
  elif spec.cache_dtype == "fp8_per_token_head":
    k, v = k.view(torch.float8_e4m3fn), v.view(torch.float8_e4m3fn)
  if spec.cache_dtype.endswith("per_token_head"):
    ks, vs = tb.kv_scale_views(cache_t, spec)
  return k, v, ks, vs


def attention(spec, cache_t, q, *, cu_seqlens_q, seqused_k, block_table, max_seqlen_q: int,
              max_seqlen_k: int, scale: float, causal=True, window=None, soft_cap=None,
              sinks=None, k_scale=None, v_scale=None, use_3d=False):
  """A zero-argument function running vLLM's ``unified_attention`` once; returns its output.

  cache_t: kvjax's cache as a torch logical tensor (``torch_bridge.to_torch``); q ``[T, Hq, D]``;
  metadata int32 CUDA tensors as vLLM names them. ``use_3d`` takes vLLM's split-KV decode
  path (buffers allocated here; vLLM uses it only for decode batches under its threshold).
  """
  import torch
  attn, _, mode = _modules()
  k, v, ks, vs = _views(cache_t, spec)
  t, hq, d = q.shape
  h = spec.num_kv_heads
  out = torch.empty_like(q)
  qmode = getattr(mode, _QUANT_MODE[spec.cache_dtype])
  s = seqused_k.shape[0]
  desc = {}
  if qmode == mode.FP8_PER_TENSOR:
    def per_seq(x):
      x = torch.as_tensor(1.0 if x is None else x, dtype=torch.float32, device=q.device)
      return x.reshape(-1).expand(h).reshape(1, h).expand(s, h).contiguous()
    desc = dict(q_descale=None, k_descale=per_seq(k_scale), v_descale=per_seq(v_scale))
  else:
    desc = dict(q_descale=None, k_descale=None, v_descale=None)
  extra = {}
  if use_3d:
    dp = 1 << (d - 1).bit_length()
    extra = dict(seq_threshold_3D=1 << 30, num_par_softmax_segments=NUM_SEGMENTS,
                 softmax_segm_output=torch.empty((t, hq, NUM_SEGMENTS, dp), dtype=torch.float32,
                                                 device=q.device),
                 softmax_segm_max=torch.empty((t, hq, NUM_SEGMENTS), dtype=torch.float32,
                                              device=q.device),
                 softmax_segm_expsum=torch.empty((t, hq, NUM_SEGMENTS), dtype=torch.float32,
                                                 device=q.device))
  win = (-1, -1) if window is None else (window - 1, 0)

  def run():
    attn.unified_attention(
        q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, scale, causal, win,
        block_table, 0.0 if soft_cap is None else soft_cap, sinks=sinks, kv_quant_mode=qmode,
        k_scale_cache=ks, v_scale_cache=vs, **desc, **extra)
    return out
  return run


def write(spec, cache_t, key, value, slot_mapping, *, k_scale=None, v_scale=None):
  """vLLM's cache writer for ``spec``'s format, in place into ``cache_t`` (logical torch view).

  key, value ``[T, H, D]`` torch CUDA tensors in the model dtype; slot_mapping int64 ``[T]``.
  """
  import torch
  _, writer, mode = _modules()
  k, v, ks, vs = _views(cache_t, spec)
  qmode = getattr(mode, _QUANT_MODE[spec.cache_dtype])
  if spec.cache_dtype.endswith("per_token_head"):
    writer.triton_reshape_and_cache_flash_per_token_head_quant(key, value, k, v, ks, vs,
                                                                slot_mapping, qmode)
    return
  one = torch.ones((), dtype=torch.float32, device=key.device)
  kv_dtype = "auto" if qmode == mode.NONE else "fp8"
  writer.triton_reshape_and_cache_flash(
      key, value, k, v, slot_mapping, kv_dtype,
      one if k_scale is None else torch.as_tensor(k_scale, dtype=torch.float32,
                                                 device=key.device),
      one if v_scale is None else torch.as_tensor(v_scale, dtype=torch.float32,
                                                 device=key.device))


def int4_rotate(x):
  """vLLM's int4 pre-rotation of ``x [..., D]`` (torch CUDA, model dtype): its
  ``single_rht(x.float()).to(x.dtype)``, as its writer (K/V) and attention (q) apply it."""
  return _int4_module().single_rht(x.float()).to(x.dtype)


def write_int4_rotated(spec, cache_t, key_rotated, value_rotated, slot_mapping):
  """vLLM's int4 quantize-and-store kernel alone, on rows already rotated (no rotation here):
  isolates vLLM's quantizer from its Hadamard transform."""
  int4 = _int4_module()
  k, v, ks, vs = _views(cache_t, spec)
  int4._run_reshape_kernel(int4._reshape_cache_int4_kernel, key=key_rotated,
                           value=value_rotated, key_cache=k, value_cache=v, k_scale_cache=ks,
                           v_scale_cache=vs, slot_mapping=slot_mapping, packing_factor=2)
