"""Codecs: one per cache format kind (see :mod:`kvjax.codecs.base` for the interface)."""
from kvjax.codecs.address import RowAddress, ViewGeometry
from kvjax.codecs.base import Codec
from kvjax.codecs.fp8_per_tensor import Fp8PerTensorCodec
from kvjax.codecs.int4_per_token_head import Int4PerTokenHeadCodec
from kvjax.codecs.nvfp4 import Nvfp4Codec
from kvjax.codecs.per_token_head import PerTokenHeadCodec
from kvjax.codecs.plain import PlainCodec

__all__ = ["Codec", "RowAddress", "ViewGeometry", "PlainCodec", "Fp8PerTensorCodec",
           "PerTokenHeadCodec", "Int4PerTokenHeadCodec", "Nvfp4Codec"]
