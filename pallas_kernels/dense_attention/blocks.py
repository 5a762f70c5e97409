"""Block sizes of the HCA dense decode attention kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import check_positive, next_power_of_two


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the HCA dense decode attention.

    Attributes:
      entries_per_block: C128 entries folded per step (TPU: rounded down to whole pages, at
        least one, copied page by page into a double-buffered VMEM block; GPU: one gathered
        tile, a power of two).
      heads_per_block: GPU only: query heads per program.
      num_splits: GPU only: programs per (slot, head block) along the entries (split-K);
        XLA merges their partial softmax states.
    """

    entries_per_block: int = 256
    heads_per_block: int = 16
    num_splits: int = 1

    def __post_init__(self):
        check_positive(self)

    def clamped(self, capacity: int, heads: int) -> BlockSizes:
        """Blocks no larger than the problem: capacity = entries a page-table row can hold."""
        entries = min(self.entries_per_block, next_power_of_two(capacity))
        return BlockSizes(
            entries_per_block=entries,
            heads_per_block=min(self.heads_per_block, next_power_of_two(heads)),
            num_splits=max(1, min(self.num_splits, -(-capacity // entries))),
        )

    def pages_per_block(self, entries_per_page: int) -> int:
        return max(1, self.entries_per_block // entries_per_page)
