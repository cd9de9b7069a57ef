"""What the Mosaic GPU ragged kernel (:mod:`.kernel`) is compiled for: its static facts
(:class:`KernelStatics`) and the register split of its warpgroups."""
from __future__ import annotations

import dataclasses
from typing import Optional

from pallas_kernels.mosaic_gpu import tiles as TL

SWIZZLE_ELEMS = 64   # 16-bit elements per row of the 128-byte swizzle


@dataclasses.dataclass(frozen=True)
class KernelStatics:
  """Everything static the kernel body needs."""
  geo: TL.TileGeometry
  head_size: int             # D
  num_kv_heads: int          # H
  layout: str                # "NHD" / "HND"
  num_blocks: int            # B
  max_blocks: int            # block_table.shape[1]
  num_tiles: int
  causal: bool
  window: Optional[int]
  soft_cap: Optional[float]
  has_sinks: bool
  scale: Optional[float]     # None: traced, read from the kernel's scale operand
  dtype: object              # q / cache element dtype (16-bit)
  interpret: bool = False    # Mosaic GPU interpret mode (CPU)
  pv: str = TL.DEFAULT_PV      # one of tiles.PV_VARIANTS
  ping_pong: bool = True     # two consumer warpgroups alternate on the tensor cores
  num_programs: int = 0      # CUDA blocks, each walking its share of the work items
                             # (0: one block per work item)
  staging: str = TL.STAGING_PLAIN   # how q and the output pass through shared memory
                                    # (tiles.STAGINGS, tiles.choose_staging)
  registers: Optional[tuple[int, int]] = None   # (consumer, producer) registers a thread
                                                # after the split; None: default_registers
  out_factor: Optional[float] = None  # with the rotation's matrix operand: the kernel
                                      # rotates q and un-rotates its output (x this factor)
                                      # itself (Rotation.products); None: no rotation
  ops: object = None         # a quantized format's hooks (formats.Operands) when the
                             # kernel reads its pages as stored (ragged_landing); None: the
                             # cache is plain (q's dtype)

  @property
  def rotation(self) -> bool:
    """Whether the kernel applies the cache format's rotation to q and its output."""
    return self.out_factor is not None

  def __post_init__(self):
    if self.pv not in TL.PV_VARIANTS:
      raise ValueError(f"pv variant {self.pv!r} is not one of {TL.PV_VARIANTS}")
    if self.interpret and self.pv != TL.PV_SMEM_FRESH:
      raise ValueError(f"interpret mode runs only the {TL.PV_SMEM_FRESH!r} variant, got "
                       f"{self.pv!r}")
    if self.staging not in TL.STAGINGS:
      raise ValueError(f"staging {self.staging!r} is not one of {TL.STAGINGS}")
    if self.num_programs < 0:
      raise ValueError(f"num_programs={self.num_programs} must be >= 0")
    if self.registers is not None:
      check_registers(self.registers, self.geo.num_wgs)

  @property
  def register_split(self) -> tuple[int, int]:
    """(consumer, producer) registers a thread the warpgroups set at their start."""
    return self.registers or default_registers(self.geo.num_wgs)

  @property
  def landing(self) -> int:
    """Bytes of one side's stored key row as it lands before conversion (0: a plain cache,
    copied straight into the K/V slots)."""
    return 0 if self.ops is None else landing_bytes(self.ops, self.head_size)

  @property
  def num_items(self) -> int:
    """Work items: one per (KV head, query tile)."""
    return self.num_kv_heads * self.num_tiles

  @property
  def stage_chunks(self) -> int:
    """64-column chunks of each staging buffer row (``staging``): ``D / 64`` when swizzled,
    0 for the plain buffer of whole rows."""
    return 0 if self.staging == TL.STAGING_PLAIN else self.head_size // SWIZZLE_ELEMS

  @property
  def grid_size(self) -> int:
    """CUDA blocks launched: ``num_programs`` (at most one per work item), or one per item."""
    return min(self.num_programs or self.num_items, self.num_items)


def landing_bytes(ops, head_size: int) -> int:
  """Bytes of one side's stored key row of a format read as stored (``ops``: its
  :class:`.formats.Operands`; None: 0)."""
  return 0 if ops is None else ops.landing_cols(head_size) * ops.storage.itemsize


#: Registers of the block's threads together: 64 K per SM, one block per SM.
_REGISTER_FILE = 64 * 1024
_WG_THREADS = 128


def register_budget(num_wgs: int) -> int:
  """Registers one thread of each warpgroup (the consumers and the producer) hold together:
  what ptxas gives every thread at launch (the register file over the block's threads,
  rounded down to 8) times the warpgroups."""
  return _REGISTER_FILE // (_WG_THREADS * (num_wgs + 1)) // 8 * 8 * (num_wgs + 1)


def default_registers(num_wgs: int) -> tuple[int, int]:
  """(consumer, producer) registers a thread: the producer keeps 40, the consumers share
  the rest up to 240 (two consumers: 232 each)."""
  return min(240, (register_budget(num_wgs) - 40) // num_wgs // 8 * 8), 40


def check_registers(registers, num_wgs: int) -> None:
  """ValueError unless ``registers`` is a (consumer, producer) pair of multiples of 8 in
  [24, 256] whose total over the block's warpgroups fits the launch's pool."""
  ok = (isinstance(registers, tuple) and len(registers) == 2
        and all(isinstance(r, int) and r % 8 == 0 and 24 <= r <= 256 for r in registers))
  if not ok:
    raise ValueError(f"registers must be (consumer, producer), multiples of 8 in [24, 256], "
                     f"got {registers!r}")
  total, budget = num_wgs * registers[0] + registers[1], register_budget(num_wgs)
  if total > budget:
    raise ValueError(f"registers {registers} need {total} a thread over {num_wgs} consumer "
                     f"warpgroups and the producer; the launch gives {budget}")
