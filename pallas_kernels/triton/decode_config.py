"""Static tuning of the paged decode kernel: a frozen config and the split-count rule.

Every field is static (hashable): it picks a compiled program, never a value
read at run time.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from pallas_kernels.triton.formats import TileFormat

#: Streaming multiprocessors of the H200 (and H100 SXM); used only to size the grid.
NUM_SMS = 132


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Knobs of the Pallas-Triton decode kernel.

  Attributes:
    tokens_per_step: KV tokens gathered by one load per step (a power of two,
      >= 16); a step spans ``tokens_per_step / block_size`` pages (at least one).
    num_splits: KV splits per (sequence, KV head); None = :func:`choose_num_splits`.
    target_programs: with ``num_splits=None``, aim for at least this many programs
      (sequences x KV heads x splits) so that few long sequences still fill the SMs. (H200,
      one-byte formats, 2026-12-03: 4, 6, 12 and 16 x 132 instead of 8 x 132 were no faster
      across shapes, within the spread between rounds; benchmarks/RESULTS.md.)
    single_pass_programs: with ``num_splits=None``, use one split (the kernel then
      normalizes and writes the output itself, no merge pass) once sequences x KV
      heads reach this many programs.
    prefetch: carry the next step's K/V tiles through the loop (loads of step
      i+1 are issued before the math of step i).
    num_warps, num_stages: Triton launch parameters.
    fast_decode: the format hooks' :attr:`~pallas_kernels.triton.formats.TileFormat.fast_decode`
      (float16 operands from the stored bits); False converts element by element.
    scale_words: per-token-head formats of one-byte storage read their float32 row scales
      from a float32 view of the pages (one load instead of four byte loads a scale; the
      view is a bitcast: no copy, measured on the H200).
    compute_dtype: dot operand dtype by name ("float16", "bfloat16", "float32"); None = the
      one rule of :func:`pallas_kernels.common.compute_dtype`.
    pair_codes: formats of one-byte codes (fp8 per tensor, int8 / fp8 per token-head) read
      as uint16 words of two codes, split into even / odd head-dim operands in registers
      (:mod:`pallas_kernels.triton.pairs`), int4 and nvfp4 as uint16 words of four codes
      split into four head-dim parts; False reads bytes.
    page_block_ids: read a step's block ids once a page and spread each over the page's keys
      (steps of whole pages), instead of once a key. In the sm_90 machine code the
      per-token-head formats issue 5-12 % fewer instructions a step (fp8 per tensor 10 %
      more), but on the H200 no format got faster by more than the spread between runs
      (64 x 4096, 2026-12-03): off by default.
    merge_in_kernel: with several splits, the split that finishes a (sequence, KV head) last
      (an atomic counter a pair) merges the partials of all splits and writes the output,
      instead of a merge in XLA after the kernel. On the H200 (2026-12-03, profiler trace) the
      XLA merge takes 4.0-4.2 µs a step at 64 x 4096 and 5.5-10.7 at 8 x 32768, and merging in
      the kernel lengthens the kernel by as much (its last splits merge after their own keys):
      level, so off by default.
  """
  tokens_per_step: int = 64
  num_splits: Optional[int] = None
  target_programs: int = 8 * NUM_SMS
  single_pass_programs: int = 3 * NUM_SMS
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


DEFAULT_CONFIG = DecodeConfig()


def default_config(spec) -> DecodeConfig:
  """Measured defaults for ``spec``'s format (H200, Hq=32, H=8, D=128, block 16;
  benchmarks/sweep_decode.py, results in benchmarks/RESULTS.md).

  Two-byte caches: one pass from 3 x 132 programs on (no merge; measured 3.93-3.96 TB/s at
  64 x 4096 vs 3.71-3.83 with 3 splits). One-byte caches pipeline deeper and keep splitting
  until 8 x 132 programs (64 x 4096: one pass 289-298 us vs 240-251 with 3 splits for fp8,
  396-470 vs 336-391 for the per-token-head formats, before pair codes); then the format's
  own measured overrides (:attr:`~pallas_kernels.triton.formats.TileFormat.decode_defaults`:
  fp8 per tensor read as pairs takes 128 tokens a step in 5 stages).
  """
  if spec.itemsize != 1:
    return DEFAULT_CONFIG
  config = dataclasses.replace(DEFAULT_CONFIG, num_stages=3,
                               single_pass_programs=DEFAULT_CONFIG.target_programs)
  hooks = TileFormat.of(spec)
  if config.pair_codes:
    hooks = hooks.paired(ptx=False)
  return dataclasses.replace(config, **hooks.decode_defaults)


def choose_num_splits(config: DecodeConfig, num_seqs: int, num_kv_heads: int,
                      max_blocks: int, block_size: int) -> int:
  """Splits per (sequence, KV head) from static shapes only.

  One split when ``num_seqs * num_kv_heads >= single_pass_programs``; else enough
  splits that ``num_seqs * num_kv_heads * splits >= target_programs``, never more
  than the number of steps the longest sequence can take.
  """
  if config.num_splits is not None:
    return config.num_splits
  if num_seqs * num_kv_heads >= config.single_pass_programs:
    return 1
  max_steps = max(1, -(-max_blocks * block_size // config.step_tokens(block_size)))
  base = max(1, num_seqs * num_kv_heads)
  want = -(-config.target_programs // base)
  return int(max(1, min(want, max_steps)))
