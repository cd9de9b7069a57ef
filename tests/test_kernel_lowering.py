"""Every attention kernel lowers through Pallas' Triton lowering for CUDA, on this CPU machine.

``jax.export`` with ``platforms=["cuda"]`` runs the lowering that the GPU runs (compiling the
Triton IR needs the GPU), so an op the lowering of the installed jax rejects fails here, in CI,
on jax 0.10.2 as on the GPU machine's 0.11.2.
"""
import jax
import jax.numpy as jnp
import pytest
from jax import export

from kvjax import KVCacheSpec
from kvjax import formats as F
from pallas_kernels.triton.decode import paged_decode_attention
from pallas_kernels.triton.decode_config import DecodeConfig
from pallas_kernels.triton.ragged import ragged_paged_attention

ALLOW = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
S, G, MAX_BLOCKS = 4, 4, 8


def _abstract(spec):
  cache = jax.ShapeDtypeStruct(spec.physical_shape(32), spec.storage_dtype)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  return cache, i32(S + 1), i32(S), i32(S, MAX_BLOCKS)


def _lowered_text(f, *args):
  return export.export(jax.jit(f), platforms=["cuda"], disabled_checks=ALLOW)(*args).mlir_module()


def _other_head_size(cache_dtype):
  """80 (not a power of two) where the format takes it, else 32 (int4: powers of two only)."""
  try:
    F.get_format(cache_dtype).codec.check_head_size(80)
    return 80
  except ValueError:
    return 32


CASES = [(cd, layout, d) for cd in F.CACHE_FORMATS if cd != "nvfp4"
         for layout, d in (("NHD", 128), ("HND", _other_head_size(cd)))] + [("nvfp4", "HND", 128)]


@pytest.mark.parametrize("cache_dtype,layout,head_size", CASES)
def test_decode_kernel_lowers_for_cuda(cache_dtype, layout, head_size):
  spec = KVCacheSpec(2, head_size, 16, cache_dtype, layout)
  cache, _, sl, bt = _abstract(spec)
  q = jax.ShapeDtypeStruct((S, 2 * G, head_size), jnp.bfloat16)
  ks = 0.5 if spec.format.has_tensor_scales else None
  f = lambda q, c, sl, bt: paged_decode_attention(
      q, c, spec, seq_lens=sl, block_table=bt, scale=0.1, sliding_window=64, soft_cap=30.0,
      sinks=jnp.zeros(2 * G), k_scale=ks, v_scale=ks)
  assert "xla.gpu.triton" in _lowered_text(f, q, cache, sl, bt)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2", "int8_per_token_head",
                                         "fp8_per_token_head", "int4_per_token_head", "nvfp4"])
def test_decode_pair_conversions_lower_for_cuda(cache_dtype, monkeypatch):
  """The PTX word conversions (pallas_kernels.triton.pairs) the kernel uses on an sm_90 GPU."""
  from pallas_kernels.triton import pairs
  monkeypatch.setattr(pairs, "cuda_capability", lambda: (9, 0))
  test_decode_kernel_lowers_for_cuda(cache_dtype, "HND", 128)


@pytest.mark.parametrize("cache_dtype,config", [
    ("fp8", DecodeConfig(num_splits=3, merge_in_kernel=True)),
    ("int4_per_token_head", DecodeConfig(num_splits=2, merge_in_kernel=True,
                                         page_block_ids=True)),
    ("int8_per_token_head", DecodeConfig(num_splits=2, prefetch=True, page_block_ids=True)),
    ("auto", DecodeConfig(num_splits=1, tokens_per_step=128, num_warps=8))])
def test_decode_config_options_lower_for_cuda(cache_dtype, config):
  """The paths of DecodeConfig's options (the in-kernel merge's barrier, atomic counter and
  volatile loads; block ids once a page; prefetch) lower too: interpret mode never lowers them."""
  spec = KVCacheSpec(2, 128, 16, cache_dtype, "NHD")
  cache, _, sl, bt = _abstract(spec)
  q = jax.ShapeDtypeStruct((S, 2 * G, 128), jnp.bfloat16)
  ks = 0.5 if spec.format.has_tensor_scales else None
  f = lambda q, c, sl, bt: paged_decode_attention(
      q, c, spec, seq_lens=sl, block_table=bt, scale=0.1, sinks=jnp.zeros(2 * G), k_scale=ks,
      v_scale=ks, config=config)
  assert "xla.gpu.triton" in _lowered_text(f, q, cache, sl, bt)


@pytest.mark.parametrize("cache_dtype,layout,head_size", CASES)
def test_ragged_kernel_lowers_for_cuda(cache_dtype, layout, head_size):
  spec = KVCacheSpec(2, head_size, 16, cache_dtype, layout)
  cache, qsl, sl, bt = _abstract(spec)
  q = jax.ShapeDtypeStruct((64, 2 * G, head_size), jnp.bfloat16)
  ks = 0.5 if spec.format.has_tensor_scales else None
  f = lambda q, c, qsl, sl, bt: ragged_paged_attention(
      q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=0.1,
      sliding_window=64, soft_cap=30.0, sinks=jnp.zeros(2 * G), k_scale=ks, v_scale=ks,
      max_query_len=32)
  assert "xla.gpu.triton" in _lowered_text(f, q, cache, qsl, sl, bt)


@pytest.mark.parametrize("cache_dtype,layout,head_size,q_dtype,max_query_len", [
    ("int4_per_token_head", "NHD", 64, jnp.bfloat16, 64),    # 256-row prefill tile
    ("int4_per_token_head", "HND", 16, jnp.float32, 1),      # D/2 = 8: a padded tile
    ("nvfp4", "HND", 64, jnp.bfloat16, 64),
    ("nvfp4", "HND", 32, jnp.float16, 1),                    # V scales stored linearly
])
def test_ragged_split_formats_lower_for_cuda(cache_dtype, layout, head_size, q_dtype,
                                             max_query_len):
  """int4 / nvfp4 through the ragged kernel's split-format path: other tiles, q dtypes, D."""
  spec = KVCacheSpec(2, head_size, 16, cache_dtype, layout)
  cache, qsl, sl, bt = _abstract(spec)
  q = jax.ShapeDtypeStruct((64, 2 * G, head_size), q_dtype)
  ks = 0.5 if spec.format.has_tensor_scales else None
  f = lambda q, c, qsl, sl, bt: ragged_paged_attention(
      q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=0.1,
      causal=max_query_len > 1, soft_cap=30.0, k_scale=ks, v_scale=ks,
      max_query_len=max_query_len)
  text = _lowered_text(f, q, cache, qsl, sl, bt)
  assert "xla.gpu.triton" in text and "kvjax_ragged_paged_attention_split" in text
