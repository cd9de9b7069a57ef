"""A test-only cache format kind, added by this one file plus one table line.

"toy_scaled_bf16": bfloat16 storage of ``x / k_scale`` (saturated to bf16's finite range),
read back as ``stored * k_scale``: a new kind with its own codec. Its facts (bf16 rows, a
per-tensor scale) are ones the Triton adapter table's row adapter already matches, so the
Triton kernels run it with no kernel code and no line outside this file and the table line;
the Mosaic GPU and Mosaic TPU tables match no row for it, so ``explain`` says why they pass
it over. The table line lives in the op suites' fixture
(``CACHE_FORMATS[TOY.name] = TOY``), so other tests never see the format.
"""
import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.codecs import Codec
from kvjax.formats import CacheFormat


@dataclasses.dataclass(frozen=True)
class ToyScaledCodec(Codec):
  kind = "toy_scaled"
  has_tensor_scales = True

  def encode_side(self, x, global_scale, spec):
    s = jnp.asarray(1.0 if global_scale is None else global_scale, jnp.float32)
    big = float(jnp.finfo(self.storage).max)
    return jnp.clip(x.astype(jnp.float32) * (1.0 / s), -big, big).astype(self.storage)

  def decode_side(self, rows, global_scale, spec):
    s = jnp.asarray(1.0 if global_scale is None else global_scale, jnp.float32)
    return rows.astype(jnp.float32) * s


TOY = CacheFormat("toy_scaled_bf16", ToyScaledCodec(np.dtype(jnp.bfloat16)))
