"""Pallas kernels for the packed paged KV cache, one package per backend.

- ``triton/``: the Triton lowering (NVIDIA GPUs): write, decode and ragged attention,
  dequantize; per-format code only in ``triton/formats.py`` (the codecs' Triton hooks).
- ``mosaic_gpu/``: Mosaic GPU (Hopper) ragged attention.
- ``mosaic_tpu/``: Mosaic TPU write and ragged attention.
- ``common.py`` and ``ragged_schedule.py``: what every backend shares.

Backends plug into ``kvjax.registry`` (one line per op); ``docs/architecture.md`` says how.
"""
