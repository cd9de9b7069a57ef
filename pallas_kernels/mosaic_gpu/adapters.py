"""The Mosaic GPU backend's adapter table: which operand hooks (:mod:`.formats`) read a codec.

Rows match a codec's facts (:mod:`kvjax.adapters`): plain rows (values stored as they are,
16-bit storage checked by :meth:`.formats.PlainOperands.reason`), rows of fp8 values with
per-tensor scales, rows of one-byte values (int8 / fp8) each ending in its float32 scale and
rows of int4 codes ending in a scale with a zero point (:mod:`.row_formats`), and nvfp4's
sides of e2m1 codes with a scale per 16 values (:mod:`.group_formats`).
The decode kernel reads these formats directly. The ragged kernel reads plain rows as they
are, fp8 rows with per-tensor scales as stored (its producer converting each step,
:mod:`.ragged_landing`) or through a plain copy of the batch's pages
(:mod:`kvjax.plain_copy`; ``tuning.RAGGED_DIRECT`` says which), and every other format through
the plain copy.
"""
from __future__ import annotations

import numpy as np

from kvjax.adapters import Adapter, AdapterTable, packs, stores_fp8
from pallas_kernels.mosaic_gpu.formats import Fp8Operands, PlainOperands
from pallas_kernels.mosaic_gpu.group_formats import Nvfp4Operands
from pallas_kernels.mosaic_gpu.row_formats import Int4Operands, RowScaledOperands

ADAPTERS = AdapterTable("Mosaic GPU", (
    Adapter("plain rows", lambda c: c.content_halves and c.is_plain, PlainOperands),
    Adapter("fp8 rows with per-tensor scales",
            lambda c: (c.content_halves and c.has_tensor_scales and not c.has_row_scales
                       and stores_fp8(c)), Fp8Operands),
    Adapter("rows of int8 / fp8 values, each with a float32 scale",
            lambda c: (c.content_halves and c.has_row_scales and not isinstance(c.quant, str)
                       and np.dtype(c.quant).itemsize == 1 and c.storage.itemsize == 1),
            RowScaledOperands),
    Adapter("rows of int4 codes with a scale and zero point",
            lambda c: c.content_halves and c.has_row_scales and packs(c, "int4"), Int4Operands),
    Adapter("head-group sides of e2m1 codes with e4m3 group scales (nvfp4)",
            lambda c: not c.content_halves and packs(c, "e2m1"), Nvfp4Operands),
))
