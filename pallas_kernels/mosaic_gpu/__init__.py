"""Mosaic GPU (Hopper) kernels for the packed paged KV cache: ragged paged attention."""
