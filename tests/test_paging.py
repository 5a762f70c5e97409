import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from v4kv_jax.pools import paging

from conftest import hypothesis_examples


def _invariants(pages: paging.PageState):
    table = np.asarray(pages.page_table)
    free = np.asarray(pages.free_stack)[: int(pages.num_free)]
    refcount = np.asarray(pages.refcount)
    held = table[table >= 0]
    assert len(set(held.tolist())) == len(held), "a page is held twice"
    assert not set(held.tolist()) & set(free.tolist()), "a held page is on the free stack"
    assert len(held) + len(free) == pages.num_pages
    assert (refcount[held] == 1).all() and (refcount[free] == 0).all()
    for row in table:  # held pages form a prefix of the row
        n = int((row >= 0).sum())
        assert (row[:n] >= 0).all()


# Jitted once for all examples: eager, each call dispatches its ops one by one.
_allocate = jax.jit(paging.allocate, static_argnums=(4, 5))
_release = jax.jit(paging.release)


@settings(max_examples=hypothesis_examples(100), deadline=None)
@given(st.lists(st.lists(st.integers(0, 300), min_size=3, max_size=3), min_size=1, max_size=6),
       st.lists(st.booleans(), min_size=6, max_size=6))
def test_allocate_release_keep_the_pool_consistent(steps, releases):
    pages = paging.PageState.create(num_pages=9, max_slots=3, max_pages_per_seq=4)
    lengths = np.zeros(3, np.int64)
    for i, adds in enumerate(steps):
        new = lengths + np.asarray(adds)
        wants = (np.asarray(adds) > 0) & (new <= 4 * 128)
        before = int(pages.num_free)
        pages, granted = _allocate(pages, jnp.arange(3), jnp.asarray(new, jnp.int32),
                                   jnp.asarray(wants), 128, 4)
        granted = np.asarray(granted)
        need = -(-new // 128) - -(-lengths // 128)
        assert int(pages.num_free) == before - int(need[granted].sum())
        lengths = np.where(granted, new, lengths)
        assert (np.asarray(paging.held_pages(pages.page_table)) == -(-lengths // 128)).all()
        _invariants(pages)
        if releases[i]:
            pages = _release(pages, jnp.asarray([True, False, False]))
            lengths[0] = 0
            _invariants(pages)


def test_greedy_grant_skips_a_slot_that_does_not_fit():
    pages = paging.PageState.create(num_pages=3, max_slots=3, max_pages_per_seq=4)
    pages, granted = paging.allocate(pages, jnp.arange(3), jnp.asarray([300, 256, 100]),
                                     jnp.asarray([True, True, True]), 128, 4)
    # Slot 0 takes 3 pages; slot 1 (2 pages) and slot 2 (1 page) find none left.
    assert np.asarray(granted).tolist() == [True, False, False]
    assert np.asarray(pages.page_table[0]).tolist() == [0, 1, 2, -1]
    assert (np.asarray(pages.page_table[1:]) == -1).all()


def test_shared_page_is_freed_only_by_its_last_holder():
    pages = paging.PageState.create(num_pages=4, max_slots=2, max_pages_per_seq=2)
    pages, _ = paging.allocate(pages, jnp.arange(1), jnp.asarray([128]), jnp.asarray([True]),
                               128, 2)
    shared = pages.replace(page_table=pages.page_table.at[1, 0].set(0),
                           refcount=pages.refcount.at[0].set(2))
    one = paging.release(shared, jnp.asarray([True, False]))
    assert int(one.refcount[0]) == 1 and int(one.num_free) == 3
    both = paging.release(one, jnp.asarray([False, True]))
    assert int(both.refcount[0]) == 0 and int(both.num_free) == 4
    assert sorted(np.asarray(both.free_stack).tolist()) == [0, 1, 2, 3]


def test_entry_pages_maps_entries_to_page_and_row():
    rows = jnp.asarray([[7, 3, -1]])
    page, row = paging.entry_pages(rows, jnp.asarray([[0, 31, 32, 63, 64, -1, 200]]), 32)
    assert np.asarray(page).tolist() == [[7, 7, 3, 3, -1, -1, -1]]
    assert np.asarray(row)[0, :5].tolist() == [0, 31, 0, 31, 0]


def _fold_log(rows, num_entries, chunk_pages, steps=16):
    """(first entry, pages) of each step of fold_page_chunks, and the page ids each step
    handed over, written at their pages (-9 where no step read)."""
    rows = jnp.asarray(rows, jnp.int32)

    def body(carry, ids, first):
        log, seen, n = carry
        log = log.at[n].set(jnp.stack([first, jnp.int32(ids.shape[1])]))
        seen = jax.lax.dynamic_update_slice(seen, ids, (0, first // 32))
        return log, seen, n + 1

    init = (jnp.full((steps, 2), -1, jnp.int32),
            jnp.full((rows.shape[0], paging.padded_pages(rows.shape[1], chunk_pages)), -9,
                     jnp.int32), jnp.int32(0))
    log, seen, n = paging.fold_page_chunks(rows, jnp.asarray(num_entries), 32, chunk_pages,
                                           body, init)
    return [tuple(x) for x in np.asarray(log)[:int(n)].tolist()], np.asarray(seen)


def test_fold_page_chunks_hands_each_step_its_pages_and_first_entry():
    # 5 pages of 32 entries, 2 pages per step; the longer row needs 150 entries (5 pages):
    # two whole steps at entries 0 and 64, then the page left over in a step of one page.
    rows = [[10, 11, 12, 13, 14], [20, 21, -1, -1, -1]]
    log, seen = _fold_log(rows, [150, 40], 2)
    assert log == [(0, 2), (64, 2), (128, 1)]
    assert seen.tolist() == [[10, 11, 12, 13, 14, -9], [20, 21, -1, -1, -1, -9]]
    assert _fold_log(rows, [64, 0], 2)[0] == [(0, 2)]
    assert _fold_log(rows, [0, 0], 2)[0] == []


def test_fold_page_chunks_reads_the_pages_left_over_in_small_steps():
    # 16 pages per step, the pages left over 2 at a time: every needed page is read once, in
    # order, and at most one page past them; no step reaches past the padded row (48 pages).
    max_pages = 40
    rows = np.arange(100, 100 + max_pages)[None]
    assert paging.tail_chunk_pages(16) == 2
    assert paging.tail_chunk_pages(12) == 1 and paging.tail_chunk_pages(128) == 16
    with pytest.raises(ValueError, match=r"chunk_pages: expected an integer in \[1, inf\]"):
        paging.tail_chunk_pages(0)
    for entries in (1, 32, 33, 16 * 32, 16 * 32 + 1, 35 * 32 - 5, max_pages * 32):
        log, seen = _fold_log(rows, [entries], 16)
        pages = -(-entries // 32)
        read = seen[0][seen[0] != -9]
        assert read.tolist()[:pages] == rows[0, :pages].tolist(), entries
        assert pages <= len(read) <= pages + 1, (entries, len(read))
        assert [size for _, size in log] == [16] * (pages // 16) + [2] * -(-(pages % 16) // 2)
        assert all(first // 32 + size <= 48 for first, size in log)


def test_prefix_sizes_and_bucket():
    assert paging.prefix_sizes(288, 32) == [32, 64, 128, 256, 288]
    assert paging.prefix_sizes(8, 0) == [1, 2, 4, 8] and paging.prefix_sizes(4, 16) == [4]
    sizes = [128, 256, 384, 512]
    got = [int(paging.prefix_bucket(sizes, jnp.int32(n))) for n in (0, 128, 129, 384, 385, 999)]
    assert got == [0, 0, 1, 2, 3, 3]
    with pytest.raises(ValueError, match=r"capacity: expected an integer in \[1, inf\]"):
        paging.prefix_sizes(0, 1)
    with pytest.raises(TypeError, match="smallest: expected an integer"):
        paging.prefix_sizes(8, 2.5)
    with pytest.raises(ValueError, match="sizes: expected a non-empty ascending list"):
        paging.prefix_bucket([4, 2], jnp.int32(1))
