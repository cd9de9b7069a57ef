"""The Mosaic GPU backend's adapter table: which operand hooks (:mod:`.formats`) read a codec.

Rows match a codec's facts (:mod:`kvjax.adapters`): plain rows (values stored as they are,
16-bit storage checked by :meth:`.formats.PlainOperands.reason`) and rows of fp8 values with
per-tensor scales. The decode kernel reads these formats directly; the ragged kernel reads
every other format through a plain copy of the batch's pages (:mod:`kvjax.plain_copy`).
"""
from __future__ import annotations

from kvjax.adapters import Adapter, AdapterTable, stores_fp8
from pallas_kernels.mosaic_gpu.formats import Fp8Operands, PlainOperands

ADAPTERS = AdapterTable("Mosaic GPU", (
    Adapter("plain rows", lambda c: c.content_halves and c.is_plain, PlainOperands),
    Adapter("fp8 rows with per-tensor scales",
            lambda c: (c.content_halves and c.has_tensor_scales and not c.has_row_scales
                       and stores_fp8(c)), Fp8Operands),
))
