"""tests/triton_ir.py: the Triton IR of a Pallas-Triton kernel, lowered for CUDA on a CPU."""
import jax
import jax.numpy as jnp

from kvjax import KVCacheSpec
from pallas_kernels.triton.decode import paged_decode_attention
from pallas_kernels.triton.decode_config import DecodeConfig
from triton_ir import triton_kernels


def test_decode_kernel_ir_and_launch_parameters():
  """One ``tt`` module with the config's warps and stages; locations only in ``text``."""
  s, h, g, d, n, m = 4, 2, 4, 64, 16, 4
  spec = KVCacheSpec(h, d, n, "fp8", "NHD")
  config = DecodeConfig(tokens_per_step=32, num_splits=2, num_warps=2, num_stages=3)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  fn = lambda q, c, sl, bt: paged_decode_attention(
      q, c, spec, seq_lens=sl, block_table=bt, scale=0.125, k_scale=0.5, v_scale=0.5,
      config=config)
  (k,) = triton_kernels(fn, jax.ShapeDtypeStruct((s, h * g, d), jnp.bfloat16),
                        jax.ShapeDtypeStruct(spec.physical_shape(s * m), spec.storage_dtype),
                        i32(s), i32(s, m))
  assert k.name == "kvjax_paged_decode" and (k.num_warps, k.num_stages) == (2, 3)
  for text in (k.text, k.text_plain):
    assert "tt.func public @kvjax_paged_decode" in text and "tt.dot" in text
  assert "loc(" in k.text and "loc(" not in k.text_plain
