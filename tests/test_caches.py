"""Pure unit tests of the prefix row store and the step cache (no engine)."""

from __future__ import annotations

import torch

from uhead_vllm.generation.prefix_store import PrefixRowStore, block_keys
from uhead_vllm.generation.step_cache import StepCache, StepRecord


def rec(text: str) -> StepRecord:
    return StepRecord(text=text, token_ids=[], hidden=torch.empty(0, 1, 1))


def test_block_keys_depend_on_every_earlier_token():
    a = block_keys(list(range(8)), 4, 2)
    b = block_keys([99] + list(range(1, 8)), 4, 2)
    assert a[0] != b[0] and a[1] != b[1]  # second block's key changes with the first block's tokens
    assert block_keys(list(range(8)), 4, 2) == a


def test_store_fills_only_matching_full_blocks_and_evicts_lru():
    ids = list(range(10))
    rows = torch.randn(10, 2, 3)
    store = PrefixRowStore(block_size=4, max_bytes=4 * 2 * 3 * 4 * 2)  # room for two blocks
    assert store.put(ids, rows, torch.ones(10, dtype=torch.bool)) == 2  # the partial block is not stored
    out, valid = torch.empty(10, 2, 3), torch.zeros(10, dtype=torch.bool)
    assert store.fill(ids, out, valid) == 8
    assert torch.equal(out[:8], rows[:8]) and not valid[8:].any()
    other = [0, 1, 2, 3, 50, 5, 6, 7, 8, 9]  # differs in block 1: only block 0 may be filled
    out2, valid2 = torch.empty(10, 2, 3), torch.zeros(10, dtype=torch.bool)
    assert store.fill(other, out2, valid2) == 4
    store.put([7] * 8, torch.randn(8, 2, 3), torch.ones(8, dtype=torch.bool))  # evicts the oldest
    assert len(store) == 2 and store.evictions == 2


def test_step_cache_continues_trims_and_keeps_candidates_apart():
    cache = StepCache(max_idle_calls=2)
    cache.begin_call()
    p = "Q: 2+3*4?\n"
    parent = cache.history_for(p)
    a = cache.extend(p, rec("3*4 = 12\n"), parent)
    b = cache.extend(p, rec("2+3 = 5\n"), parent)
    assert [r.text for r in a] == ["3*4 = 12\n"] and [r.text for r in b] == ["2+3 = 5\n"]
    cache.begin_call()
    # continuation with re-tokenised / whitespace-normalised text and a trimmed candidate
    assert [r.text for r in cache.history_for(p + "3*4 = 12\n")] == ["3*4 = 12\n"]
    assert [r.text for r in cache.history_for(p + "2+3 = 5")] == ["2+3 = 5\n"]
    assert [r.text for r in cache.history_for(p + "3*4 = 12\n2+12 = 14")] == ["3*4 = 12\n"]
    assert cache.history_for("unrelated prompt") == []
    assert cache.history_for(p) == []  # the bare prompt is a fresh start, not a candidate
    cache.begin_call()
    cache.begin_call()
    cache.begin_call()
    assert len(cache) == 0  # idle entries are dropped


def test_step_cache_rule_when_a_candidate_is_a_prefix_of_a_sibling():
    """The rule (module docstring of step_cache): a prompt continues the candidate whose whole text
    it starts with (longest such wins); a prompt that reaches further, into a longer candidate's
    text, continues that one trimmed; among trimmed matches, the least trimmed (shortest) wins."""
    cache = StepCache(max_idle_calls=2)
    cache.begin_call()
    p = "Q: 2+3*4?\n"
    short, long_ = "3*4 = 12", "3*4 = 12\n2+12 = 14"  # the short text is a prefix of its sibling's
    parent = cache.history_for(p)
    cache.extend(p, rec(short), parent)
    cache.extend(p, rec(long_), parent)
    cache.begin_call()
    hist = lambda prompt: [r.text for r in cache.history_for(prompt)]  # noqa: E731
    assert hist(p + short) == [short]  # exact: the short candidate, not the long one trimmed back
    assert hist(p + short + "\n") == [short]  # trailing whitespace is not text
    assert hist(p + short + "\n2+12") == [long_]  # reaches into the long one: it was trimmed
    assert hist(p + long_) == [long_]
    assert hist(p + long_ + "\nSo 14.") == [long_]  # continues the long one
    assert hist(p + "3*4 = 1") == [short]  # trimmed inside both: the least trimmed away
    # The order in which siblings were recorded does not matter.
    other = StepCache(max_idle_calls=2)
    other.begin_call()
    other.extend(p, rec(long_), [])
    other.extend(p, rec(short), [])
    other.begin_call()
    for prompt in (p + short, p + short + "\n2+12", p + long_, p + "3*4 = 1"):
        assert [r.text for r in other.history_for(prompt)] == hist(prompt), prompt
