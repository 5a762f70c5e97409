"""The two pools as one pytree, `Cache`, in four rooms:

  pools.tree       the pytree, its typed fields and the accessors; `init_cache`
  pools.slots      the slot lifecycle: reset, release, clear flags
  pools.transfers  pages and State in and out: attach, hold, drop, read and load pages,
                   snapshot and restore State (the host and disk tiers grow here)
  pools.report     inspection: slots, a slot's contents, bytes, the memory report
                   (a V4.1 cache's: pools.report41)

Every public name is also reachable as `pools.<name>`.

Every stored array is a `Lanes` (`pools.lanes`): the planes of its *blocks* and the
`LaneMap` that says where each row of a block lives (lane rows of 128 words, rows narrower
than a lane row sharing one in slots), so that a TPU keeps every pool row-major with little
padding. Below, a block's rows are given as [rows, sw], its logical view
(`Lanes.records()`); the leading dims are the block dims.

Classical pool (complete, immutable entries; paged; shared by all requests), one typed
store per compressed layer kind:
  csa: CSAEntries
    c4          blocks [n_csa, num_pages], each P // m rows of sw(head_dim)   C4 entries
    index_keys  blocks [n_csa, num_pages], each P // m rows of sw(index_head_dim)
                                                                             indexer keys
  hca: HCAEntries
    c128        blocks [n_hca, num_pages], each P // m' rows of sw(head_dim)  C128 entries
  pages         page tables, free stack, refcounts (see `paging`; beside the pool)

State pool (per request slot; changes every step):
  lengths       i32[max_slots]   tokens appended so far
  status        i32[max_slots]   `SlotStatus`
  window        blocks [n_layers, max_slots], each W rows of sw(head_dim): a ring, position
                p at row p % W
  csa: CSATails main and index, the CSA compressors' `Tail` rings: blocks
                [n_csa, max_slots], each `ring` rows of in_width
  hca           a `Tail` as above (hca_tail="ring"), or an `OnlineTail` of blocks
                [n_hca, max_slots] of one row of head_dim (hca_tail="online")
  hot           with hot_rows = H > 0, the CSA layers' `HotSet`: rows, blocks
                [n_csa, max_slots] of H rows of sw(head_dim); held and used, blocks of H
                int32 words (`v4kv_jax.ops.hot`); None otherwise

Kind-specific code takes a store (`csa_entries`, `hca_entries`, `csa_tails`, `hca_tail`);
code that loops over the compressors passes a `CompressorSpec` from `cache.specs` to
`entries` / `with_entries` / `tail` / `with_tail`.

Row formats: sw(width) is the stored width of a row in 32-bit words
(`storage.stored_width`): the width in float32, half of it (rounded up) in bfloat16 and
float16 (two values to a uint32 word), 146 uint32 words for an fp8_latent row of 512 values
with 64 RoPE dims, 17 for an fp4_index key of 128 values. C4 and C128 entries are in
`CacheConfig.entry_dtype`, indexer keys in `index_dtype`, the window in `window_dtype` (one
`storage.RowCodec` each: `storage.codec`), tails in `tail_dtype`. Rows are stored exactly
as `RowCodec.encode` returns them; every reader decodes with `RowCodec.decode`.

The online HCA tail (`OnlineTail`, hca_tail="online")
------------------------------------------------------
Per HCA layer and slot, three fp32 vectors of head_dim (stored in `tail_dtype`) describe the
open C128 block, positions i m' .. L - 1 of a slot of length L (i = L // m'), as an online
softmax over its tokens, channel by channel (z_t = gate_t + ape[t mod m'], a_t = kv_t):

  max       M     = max over the block's tokens so far of z_t
  sum       S     = sum of exp(z_t - M)
  weighted  U     = sum of exp(z_t - M) * a_t

Tokens are folded in position order, one at a time; the token at position t with block
offset o = t mod m' does, in fp32:

  o == 0 (a block starts; the previous block is forgotten):
      M <- z_t;  S <- 1;  U <- a_t
  o > 0:
      M' = max(M, z_t);  c = exp(M - M');  e = exp(z_t - M')
      S <- (S * c) + e;  U <- (U * c) + (e * a_t);  M <- M'

Each product is rounded to fp32 before the sum (no FMA contraction; the reference forces it,
see `compressor.online_fold`), so decode and prefill give the same bits. The compressor
kernels (`pallas_kernels.compressor`, `emit_entries_online`) use the same expressions and
rounding, so in interpret mode their tails are the reference's bit for bit (tested);
compiled, a backend's exp may differ from XLA's by an ulp, and a kernel that contracted
would differ by about an ulp per token, well within the 1e-6 of the entries.
The token at o == m' - 1 completes the block: its entry is RoPE_{i m'}(RMSNorm_w(U / S)),
the softmax pooling of the block (within 1e-6 of the raw ring's, fp32). Every chunking of
the tokens (decode, prefill, any chunk boundaries) runs the same fold per block in the same
order, so tails and entries do not depend on it. The tail is meaningful iff L mod m' != 0;
with L mod m' == 0 (an empty open block, e.g. a fresh slot or a page boundary) it holds
stale values that the next token, at o == 0, replaces without reading. 3 x 512 x 4 B = 6 KiB
per HCA layer instead of the ring's m' x 2 x 512 x 4 B (512 KiB for m' = 128).

The model and cache configs are static fields, so a jitted function taking a `Cache`
compiles once per geometry and never per length.
"""

from v4kv_jax.config import LayerKind
from v4kv_jax.pools import report, report41, slots, transfers, tree
from v4kv_jax.pools.cache41 import Cache41, init_cache41
from v4kv_jax.pools.lanes import LaneMap, Lanes
from v4kv_jax.pools.report import *  # noqa: F403
from v4kv_jax.pools.report41 import *  # noqa: F403
from v4kv_jax.pools.slots import *  # noqa: F403
from v4kv_jax.pools.transfers import *  # noqa: F403
from v4kv_jax.pools.tree import *  # noqa: F403

__all__ = ["Cache41", "LaneMap", "Lanes", "LayerKind", "init_cache41", *tree.__all__,
           *slots.__all__, *transfers.__all__, *report.__all__, *report41.__all__]
