"""The prompts the demos serve, and how two greedy runs of them are compared."""
from __future__ import annotations

import dataclasses

# Plain completions (no chat template): short, so a CPU run takes seconds. Chosen so that
# HF's float32 greedy choice never hangs on a near tie: over 16 new tokens each, its top two
# logits are at least 0.14 apart (a bf16 cache's rounding moves logits by hundredths).
PROMPTS = (
    "The capital of France is",
    "The largest planet in the solar system is",
    "Once upon a time,",
)


@dataclasses.dataclass(frozen=True)
class Agreement:
  """Greedy ids of a run against the reference's, prompt by prompt.

  A continuation agrees up to its first differing token; the tokens after a difference are
  conditioned on different text and are not compared.

  Attributes:
    same: tokens equal to the reference before each prompt's first difference, summed.
    total: reference tokens, summed over prompts.
    first_diff: per prompt, the index of the first differing token, or None when identical.
  """
  same: int
  total: int
  first_diff: tuple

  @property
  def identical(self) -> bool:
    return self.same == self.total and all(d is None for d in self.first_diff)

  def __str__(self) -> str:
    diffs = [f"prompt {i} at token {d}" for i, d in enumerate(self.first_diff) if d is not None]
    return (f"{self.same}/{self.total} ({self.same / max(self.total, 1):.1%})"
            + (f"; first difference: {', '.join(diffs)}" if diffs else ""))


def compare(ours, reference) -> Agreement:
  """:class:`Agreement` of ``ours`` with ``reference``: lists of generated id lists."""
  if len(ours) != len(reference):
    raise ValueError(f"{len(ours)} continuations vs {len(reference)} reference ones")
  same, first_diff = 0, []
  for a, b in zip(ours, reference):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
      n += 1
    same += n
    first_diff.append(None if n == len(a) == len(b) else n)
  return Agreement(same, sum(len(b) for b in reference), tuple(first_diff))
