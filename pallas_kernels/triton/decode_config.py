"""Static tuning of the paged decode kernel: a frozen config and the split-count rule.

Every field is static (hashable): it picks a compiled program, never a value
read at run time.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

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
      (sequences x KV heads x splits) so that few long sequences still fill the SMs.
    single_pass_programs: with ``num_splits=None``, use one split (the kernel then
      normalizes and writes the output itself, no merge pass) once sequences x KV
      heads reach this many programs.
    prefetch: carry the next step's K/V tiles through the loop (loads of step
      i+1 are issued before the math of step i).
    num_warps, num_stages: Triton launch parameters.
  """
  tokens_per_step: int = 64
  num_splits: Optional[int] = None
  target_programs: int = 8 * NUM_SMS
  single_pass_programs: int = 3 * NUM_SMS
  prefetch: bool = False
  num_warps: int = 4
  num_stages: int = 2

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


def default_config(cache_itemsize: int) -> DecodeConfig:
  """Measured defaults (H200, benchmarks/results/decode.md).

  Two-byte caches: one pass from 3 x 132 programs on (no merge; measured 3.93-3.96 TB/s at
  64 x 4096 vs 3.71-3.83 with 3 splits). One-byte caches are instruction-bound rather than
  byte-bound: they pipeline deeper and keep splitting until 8 x 132 programs (one pass
  measured 1.60 TB/s at 64 x 4096 vs 1.83-1.84 with 3 splits).
  """
  if cache_itemsize == 1:
    return dataclasses.replace(DEFAULT_CONFIG, num_stages=3,
                               single_pass_programs=DEFAULT_CONFIG.target_programs)
  return DEFAULT_CONFIG


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
