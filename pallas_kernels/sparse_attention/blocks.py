"""Block sizes of the CSA sparse decode attention kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import check_positive, next_power_of_two


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the CSA sparse decode attention.

    Attributes:
      picks_per_block: top-k entries gathered per step (TPU: one double-buffered batch of
        row copies; GPU: one gathered tile).
      heads_per_block: GPU only: query heads per program.
      num_splits: GPU only: programs per (slot, head block) that share the picks (split-K);
        their partial softmax states are merged in XLA.
    """

    picks_per_block: int = 128
    heads_per_block: int = 16
    num_splits: int = 1

    def __post_init__(self):
        check_positive(self)

    def clamped(self, topk: int, heads: int) -> BlockSizes:
        """Blocks no larger than the problem (powers of two, as the GPU kernel needs)."""
        return BlockSizes(
            picks_per_block=min(self.picks_per_block, next_power_of_two(topk)),
            heads_per_block=min(self.heads_per_block, next_power_of_two(heads)),
            num_splits=max(1, min(self.num_splits, -(-topk // self.picks_per_block))),
        )
