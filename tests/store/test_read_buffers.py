"""ReadBuffers: lent read buffers are reused, bounded, and never waited for."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cwm_plugin.store.read_buffers import GRAIN, ReadBuffers


def test_a_buffer_given_back_is_lent_again_and_a_smaller_one_fits_first():
    pool = ReadBuffers(keep_bytes=8 * GRAIN)
    big, small = pool.take(3 * GRAIN), pool.take(10)
    assert len(big) == 3 * GRAIN and len(small) == 10 and small.readonly is False
    big_buf, small_buf = big.obj, small.obj
    pool.give_back(big)
    pool.give_back(small)
    assert pool.free_bytes == 4 * GRAIN
    again = pool.take(100)
    assert again.obj is small_buf                    # the smallest that fits
    assert pool.take(2 * GRAIN).obj is big_buf
    new = pool.take(GRAIN).obj                        # nothing free: a new one
    assert new is not big_buf and new is not small_buf
    assert pool.free_bytes == 0


def test_it_keeps_no_more_than_its_bound_and_ignores_what_it_did_not_lend():
    pool = ReadBuffers(keep_bytes=2 * GRAIN)
    views = [pool.take(GRAIN) for _ in range(5)]   # five lent at once: no waiting
    for v in views:
        pool.give_back(v)
    assert pool.free_bytes == 2 * GRAIN
    pool.give_back(b"bytes")
    pool.give_back(memoryview(b"read-only"))
    pool.give_back(None)
    assert pool.free_bytes == 2 * GRAIN


@given(st.lists(st.integers(min_value=0, max_value=5 * GRAIN), max_size=20))
def test_every_lent_view_has_the_size_asked(sizes):
    pool = ReadBuffers(keep_bytes=4 * GRAIN)
    lent = []
    for n in sizes:
        v = pool.take(n)
        assert len(v) == n
        lent.append(v)
        if len(lent) > 2:
            pool.give_back(lent.pop(0))
    assert pool.free_bytes <= 4 * GRAIN
