"""Block sizes of the indexer score kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import check_positive, next_power_of_two


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the indexer scores.

    Attributes:
      entries_per_block: keys scored per step (TPU: rounded down to whole pages, at least
        one, copied page by page into a double-buffered VMEM block; GPU: the keys of one
        program, a power of two).
    """

    entries_per_block: int = 512

    def __post_init__(self):
        check_positive(self)

    def clamped(self, capacity: int) -> BlockSizes:
        """No larger than the keys a page-table row can hold (`capacity`)."""
        return BlockSizes(min(self.entries_per_block, next_power_of_two(capacity)))

    def pages_per_block(self, entries_per_page: int) -> int:
        return max(1, self.entries_per_block // entries_per_page)
