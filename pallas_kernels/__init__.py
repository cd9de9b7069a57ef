"""Pallas kernels for the packed paged KV cache, one package per backend.

- ``triton/``: the Triton lowering (NVIDIA GPUs): write, decode and ragged attention,
  dequantize.
- ``mosaic_gpu/``: Mosaic GPU (Hopper) decode and ragged attention.
- ``mosaic_tpu/``: Mosaic TPU write and ragged attention.
- ``common.py`` and ``ragged_schedule.py``: what every backend shares.

Each backend owns its per-format hooks, an adapter table that picks them from a codec's
facts (``adapters.py``) and its tuning table (``tuning.py``); its kernels are format-blind.
Backends plug into ``kvjax.registry`` (one line per op); ``docs/architecture.md`` says how.
"""
