"""Names pallas_kernels.mosaic_tpu imports from this former module, kept until it imports them
from their homes: kvjax.quant (rounding, bit views) and pallas_kernels.common (bytes)."""
from kvjax.quant import from_bits as from_u8  # noqa: F401
from kvjax.quant import round_half_away_from_zero as round_half_away  # noqa: F401
from kvjax.quant import to_bits as to_u8  # noqa: F401
from pallas_kernels.common import f32_to_bytes  # noqa: F401


def bytes_to_u32(b0, b1, b2, b3):
  """Four uint8 arrays (little endian) -> uint32."""
  import jax.numpy as jnp
  u32 = jnp.uint32
  return (b0.astype(u32) | (b1.astype(u32) << u32(8)) | (b2.astype(u32) << u32(16))
          | (b3.astype(u32) << u32(24)))
