"""The paged decode kernel's knobs: a frozen config.

Every field is static (hashable): it picks a compiled program, never a value read at run
time. The measured defaults and the split-count rule are in :mod:`pallas_kernels.triton.tuning`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional



@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Knobs of the Pallas-Triton decode kernel.

  Attributes:
    tokens_per_step: KV tokens gathered by one load per step (a power of two,
      >= 16); a step spans ``tokens_per_step / block_size`` pages (at least one).
    num_splits: KV splits per (sequence, KV head); None =
      :func:`pallas_kernels.triton.tuning.choose_num_splits`.
    target_programs: with ``num_splits=None``, aim for at least this many programs
      (sequences x KV heads x splits) so that few long sequences still fill the SMs; None =
      8 x the GPU's SMs.
    single_pass_programs: with ``num_splits=None``, use one split (the kernel then
      normalizes and writes the output itself, no merge pass) once sequences x KV
      heads reach this many programs; None = 3 x the GPU's SMs.
    prefetch: carry the next step's K/V tiles through the loop (loads of step
      i+1 are issued before the math of step i).
    num_warps, num_stages: Triton launch parameters.
    fast_decode: the format hooks' :attr:`~pallas_kernels.triton.formats.TileFormat.fast_decode`
      (float16 operands from the stored bits); False converts element by element.
    scale_words: per-token-head formats of one-byte storage read their float32 row scales
      from a float32 view of the pages (one load instead of four byte loads a scale; the
      view is a bitcast, no copy).
    compute_dtype: dot operand dtype by name ("float16", "bfloat16", "float32"); None = the
      one rule of :func:`pallas_kernels.common.compute_dtype`.
    pair_codes: formats of one-byte codes (fp8 per tensor, int8 / fp8 per token-head) read
      as uint16 words of two codes, split into even / odd head-dim operands in registers
      (:mod:`pallas_kernels.triton.pairs`), int4 and nvfp4 as uint16 words of four codes
      split into four head-dim parts; False reads bytes.
    page_block_ids: read a step's block ids once a page and spread each over the page's keys
      (steps of whole pages), instead of once a key; off by default (`triton-decode-page-block-ids`
      in benchmarks/RESULTS.md: no faster).
    merge_in_kernel: with several splits, the split that finishes a (sequence, KV head) last
      (an atomic counter a pair) merges the partials of all splits and writes the output,
      instead of a merge in XLA after the kernel; off by default (`triton-decode-merge`:
      level with the XLA merge).
  """
  tokens_per_step: int = 64
  num_splits: Optional[int] = None
  target_programs: Optional[int] = None
  single_pass_programs: Optional[int] = None
  prefetch: bool = False
  num_warps: int = 4
  num_stages: int = 2
  fast_decode: bool = True
  scale_words: bool = True
  compute_dtype: Optional[str] = None
  pair_codes: bool = True
  page_block_ids: bool = False
  merge_in_kernel: bool = False

  def __post_init__(self):
    t = self.tokens_per_step
    if t < 16 or t & (t - 1):
      raise ValueError(f"tokens_per_step={t} must be a power of two >= 16")
    if self.num_splits is not None and self.num_splits < 1:
      raise ValueError(f"num_splits={self.num_splits} must be >= 1")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be a power of two <= 16")

  def step_tokens(self, block_size: int) -> int:
    """Tokens per step: ``tokens_per_step`` rounded up to whole pages."""
    return max(self.tokens_per_step, block_size)


#: The knobs' defaults (what :func:`pallas_kernels.triton.tuning.decode_config` starts from).
DEFAULT_CONFIG = DecodeConfig()
