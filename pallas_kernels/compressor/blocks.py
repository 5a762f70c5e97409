"""Block sizes of the compressor kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.common import check_positive


def _floor_power_of_two(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the compressor (pool + RMSNorm + RoPE + store).

    Attributes:
      blocks_per_step: compressor blocks (entries) pooled per grid step.
      slot_rows_per_step: bound on blocks_per_step * tokens per entry (2m with overlap, m'
        without), the VMEM rows one step holds per input (TPU) or the tile rows (GPU).
      channels_per_step: GPU only: channels pooled per pass (a power of two); a tile holds
        slot_rows_per_step * channels_per_step values per input.
    """

    blocks_per_step: int = 64
    slot_rows_per_step: int = 512
    channels_per_step: int = 64

    def __post_init__(self):
        check_positive(self)

    def clamped(self, blocks: int, slots: int, width: int) -> BlockSizes:
        """Fits the problem: `blocks` entries at most per chunk, `slots` rows each."""
        per_step = min(self.blocks_per_step, blocks, max(1, self.slot_rows_per_step // slots))
        return BlockSizes(per_step, max(self.slot_rows_per_step, slots),
                          min(self.channels_per_step, width))

    def for_gpu(self, blocks: int, slots: int, width: int) -> BlockSizes:
        """`clamped`, with the power-of-two tile shapes Triton needs."""
        bs = self.clamped(blocks, slots, width)
        return BlockSizes(_floor_power_of_two(bs.blocks_per_step), bs.slot_rows_per_step,
                          _floor_power_of_two(bs.channels_per_step))
