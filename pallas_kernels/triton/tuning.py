"""The Triton kernels' tuning table: every measured default and ``auto`` rule, in one place.

Each rule names the row of ``benchmarks/RESULTS.md`` ("Tuned defaults") that justifies it,
by its id in backticks. The knobs themselves are the kernels' frozen configs
(:class:`~pallas_kernels.triton.decode_config.DecodeConfig`,
:class:`~pallas_kernels.triton.write.WriteConfig`,
:class:`~pallas_kernels.triton.ragged_kernel.TileConfig`); a caller may pass its own.
Everything here is static: it picks a compiled program from shapes and formats, never from
values read at run time.
"""
from __future__ import annotations

import dataclasses
import functools

from pallas_kernels.common import cdiv, gpu_sm_count, next_pow2
from pallas_kernels.triton.decode_config import DecodeConfig
from pallas_kernels.triton.formats import PairFormat, RowFormat, TileFormat
from pallas_kernels.triton.ragged_kernel import TileConfig

#: SMs assumed where no GPU answers (lowering on a CPU): an H100 SXM's or H200's 132.
DEFAULT_NUM_SMS = 132


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
  """Streaming multiprocessors of this process's GPU, or :data:`DEFAULT_NUM_SMS` where there
  is none. Sizes grids only."""
  return gpu_sm_count(DEFAULT_NUM_SMS)


# -- decode ---------------------------------------------------------------------------------
#: Programs (sequences x KV heads x splits) the split rule aims for, per SM
#: (`triton-decode-splits`).
SPLIT_PROGRAMS_PER_SM = 8
#: Two-byte caches run one pass (no split, no merge) from this many programs per SM on
#: (`triton-decode-splits`); one-byte caches split until :data:`SPLIT_PROGRAMS_PER_SM`.
SINGLE_PASS_PROGRAMS_PER_SM = 3


def decode_config(tf: TileFormat) -> DecodeConfig:
  """The measured decode config of a format (``tf``: its hooks, :func:`tile_format`).

  Two-byte caches: :class:`DecodeConfig`'s defaults. One-byte caches pipeline deeper
  (3 stages) and split until ``8 x SMs`` programs (`triton-decode-splits`); read as pairs of
  codes without row scales (fp8 per tensor) they take 128 keys a step in 5 stages
  (`triton-decode-fp8-keys`); the row-scaled formats keep 64 keys
  (`triton-decode-row-scaled-keys`).
  """
  sms = num_sms()
  config = DecodeConfig(target_programs=SPLIT_PROGRAMS_PER_SM * sms,
                        single_pass_programs=SINGLE_PASS_PROGRAMS_PER_SM * sms)
  if tf.storage.itemsize != 1:
    return config
  config = dataclasses.replace(config, num_stages=3,
                               single_pass_programs=config.target_programs)
  words = tf.paired(ptx=False) if config.pair_codes else tf
  if isinstance(words, PairFormat) and not words.row_scaled:
    config = dataclasses.replace(config, tokens_per_step=128, num_stages=5)
  return config


def choose_num_splits(config: DecodeConfig, num_seqs: int, num_kv_heads: int,
                      max_blocks: int, block_size: int) -> int:
  """Splits per (sequence, KV head) from static shapes only (`triton-decode-splits`).

  One split when ``num_seqs * num_kv_heads >= single_pass_programs``; else enough
  splits that ``num_seqs * num_kv_heads * splits >= target_programs``, never more
  than the number of steps the longest sequence can take. Program counts a config leaves
  None are ``3 x`` and ``8 x`` the GPU's SMs.
  """
  if config.num_splits is not None:
    return config.num_splits
  sms = num_sms()
  single = config.single_pass_programs or SINGLE_PASS_PROGRAMS_PER_SM * sms
  target = config.target_programs or SPLIT_PROGRAMS_PER_SM * sms
  if num_seqs * num_kv_heads >= single:
    return 1
  max_steps = max(1, cdiv(max_blocks * block_size, config.step_tokens(block_size)))
  base = max(1, num_seqs * num_kv_heads)
  return int(max(1, min(cdiv(target, base), max_steps)))


# -- write ----------------------------------------------------------------------------------
def write_defaults(fmt: TileFormat) -> tuple:
  """(tokens per program, contiguous pair loads) of the write kernel (`triton-write-config`):
  rows with no per-row quantization (plain, fp8 per tensor) 8 tokens a program; the
  quantize-heavy formats (per-token-head, int4, nvfp4) 1 token, even / odd lanes split in
  registers from contiguous loads."""
  if type(fmt) is RowFormat and not fmt.row_scaled:
    return 8, False
  return 1, True


# -- ragged attention -----------------------------------------------------------------------
#: Query rows of a tile, at most (compiled).
RAGGED_MAX_ROWS = 256


def ragged_tiles(head_size: int, group: int, max_query_len: int, interpret: bool,
                 compute_itemsize: int) -> TileConfig:
  """Tiles of the ragged kernel: rows from the max_query_len bucket, smaller in interpret
  mode (`triton-ragged-tiles`: 256 rows x 64 keys and 8 warps where the bucket fills them,
  else the best smaller tile)."""
  cap = 32 if interpret else RAGGED_MAX_ROWS
  rows = max(16, min(cap, next_pow2(max_query_len * group)))
  rows = max(rows, next_pow2(group))                # at least one token per tile
  if interpret:
    return TileConfig(rows=rows, block_kv=16, num_warps=4, num_stages=1)
  if head_size > 128 or compute_itemsize > 2:       # big tiles: keep registers/smem in budget
    rows = min(rows, 64)
    return TileConfig(rows=rows, block_kv=32, num_warps=4, num_stages=2)
  if rows >= 256:
    return TileConfig(rows=rows, block_kv=64, num_warps=8, num_stages=3)
  block_kv = 32 if rows >= 64 else 64   # decode-sized tiles: more keys in flight per step
  return TileConfig(rows=rows, block_kv=block_kv, num_warps=4, num_stages=3)
