"""The Mosaic TPU kernels' tuning table: their tile sizes, in one place.

None of these is measured on a TPU yet (benchmarks/RESULTS.md has no TPU row): they follow
the hardware's shapes, and a measurement that changes one changes it here.
"""
#: Tokens the write kernel encodes and copies per grid step (one sublane tile of 8 rows).
WRITE_TOKENS_PER_STEP = 8
#: Query rows (tokens x GQA group) an attention tile aims for: one MXU pass of 128 rows.
TARGET_ROWS = 128
#: Keys an attention KV step aims for (pages per step = TARGET_KEYS // block_size).
TARGET_KEYS = 256
