"""Eviction policies and budgets, without a server."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kvstore.policy import LRUPolicy, Residency, S3FIFOPolicy


def fill(residency: Residency, key: str, size: int) -> list[str]:
    victims = residency.victims_for(key, size)
    residency.add(key, size)
    return victims


def test_lru_evicts_least_recently_used():
    r = Residency(30, "lru")
    for key in "abc":
        fill(r, key, 10)
    r.touch("a")                          # order now b, c, a
    assert fill(r, "d", 10) == ["b"]
    assert fill(r, "e", 20) == ["c", "a"]
    assert set(r.sizes) == {"d", "e"} and r.used == 30


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_replacing_a_key_does_not_count_it_twice(policy):
    r = Residency(100, policy)
    fill(r, "a", 60)
    assert fill(r, "a", 70) == []         # the old copy is forgotten first, not evicted as a victim
    assert r.used == 70 and list(r.sizes) == ["a"]


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_item_over_the_whole_budget_is_refused(policy):
    r = Residency(100, policy)
    fill(r, "a", 50)
    with pytest.raises(ValueError, match="whole budget"):
        r.victims_for("big", 101)
    assert r.used == 50 and "a" in r


def test_s3fifo_keeps_a_popular_chunk_through_a_scan_that_lru_loses():
    """A chunk read a few times survives a run of one-hit chunks under S3-FIFO, not under LRU."""
    for name, expect_hot in (("lru", False), ("s3fifo", True)):
        r = Residency(100, name)
        fill(r, "hot", 10)
        for _ in range(3):
            r.touch("hot")
        fill(r, "warm", 10)
        for i in range(9):                # push "hot" to main (S3-FIFO) / to the LRU tail
            fill(r, f"a{i}", 10)
        for i in range(9):
            fill(r, f"b{i}", 10)
        assert ("hot" in r) is expect_hot, name


def test_s3fifo_ghost_hit_goes_straight_to_main():
    p = S3FIFOPolicy(budget=100)
    p.admit("x", 10)
    assert p.evict_one() == "x"           # untouched in the small queue: evicted, remembered as ghost
    p.admit("x", 10)                      # comes back: main, not small
    p.admit("y", 10)
    p.touch("y")
    assert p.evict_one() == "x"           # small is below its target, so main's head goes first
    assert p.evict_one() == "y"


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["lru", "s3fifo"]),
       ops=st.lists(st.tuples(st.sampled_from(["put", "touch", "drop"]), st.integers(0, 15), st.integers(1, 40)), max_size=200))
def test_budget_is_never_exceeded(policy, ops):
    r = Residency(100, policy)
    for op, k, size in ops:
        key = f"k{k}"
        if op == "put":
            victims = fill(r, key, size)
            assert key not in victims
        elif op == "touch":
            r.touch(key)
        else:
            r.discard(key)
        assert 0 <= r.used <= 100
        assert r.used == sum(r.sizes.values())


def test_lru_policy_alone_orders_by_recency():
    p = LRUPolicy(budget=0)
    for k in "abc":
        p.admit(k, 1)
    p.touch("a")
    assert [p.evict_one() for _ in range(3)] == ["b", "c", "a"]
