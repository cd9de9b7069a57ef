"""Plain caches: the model dtype or another float dtype, no scales."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.codecs.base import Codec


@dataclasses.dataclass(frozen=True)
class PlainCodec(Codec):
  """Values stored as they are (cast to the storage dtype); read back as float32."""
  kind = "plain"

  def encode_side(self, x, global_scale, spec):
    del global_scale
    return x.astype(spec.storage_dtype)

  def decode_side(self, rows, global_scale, spec):
    del global_scale, spec
    return rows.astype(jnp.float32)
