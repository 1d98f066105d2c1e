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
    # a shared prefix's keys hashed once continue into any sequence starting with it
    ids = list(range(21))
    prompt = block_keys(ids[:9], 4, 2, b"salt")
    assert block_keys(ids, 4, 5, b"salt", known=prompt) == block_keys(ids, 4, 5, b"salt")
    assert block_keys(ids, 4, 1, b"salt", known=prompt) == prompt[:1]


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


def test_store_keeps_views_counts_buffers_and_retires_rows_edited_in_place():
    ids = list(range(8))
    rows = torch.randn(8, 2, 3)
    store = PrefixRowStore(block_size=4, max_bytes=1 << 20)
    assert store.put(ids, rows, torch.ones(8, dtype=torch.bool), seal=False) == 2
    (block,) = {t.untyped_storage().data_ptr() for t in store.tensors()}
    assert block == rows.untyped_storage().data_ptr()  # views of the call's rows, no copy
    assert store.bytes_held == rows.numel() * rows.element_size()  # the whole buffer, once
    rows[6] += 1.0  # the caller still writes into its buffer before sealing: still served
    store.seal()
    out, valid = torch.empty(8, 2, 3), torch.zeros(8, dtype=torch.bool)
    assert store.fill(ids, out, valid) == 8 and torch.equal(out, rows)
    # A later call with the same blocks re-points them to its own buffer, releasing the old one.
    newer = rows.clone()
    assert store.put(ids, newer, torch.ones(8, dtype=torch.bool), replace=True) == 0
    assert {t.untyped_storage().data_ptr() for t in store.tensors()} == {newer.untyped_storage().data_ptr()}
    assert store.bytes_held == newer.numel() * newer.element_size()
    newer[1] *= 2.0  # edited in place after sealing (a user changing returned rows)
    out, valid = torch.empty(8, 2, 3), torch.zeros(8, dtype=torch.bool)
    assert store.fill(ids, out, valid) == 0 and not valid.any()
    assert store.stale_drops == 2 and len(store) == 0 and store.bytes_held == 0


def test_store_copies_blocks_of_a_buffer_larger_than_its_budget():
    rows = torch.randn(12, 2, 3)  # 288 bytes; budget 200: storing views would keep 288 alive
    store = PrefixRowStore(block_size=4, max_bytes=200)
    store.put(list(range(12)), rows, torch.ones(12, dtype=torch.bool))
    held = store.tensors()
    assert len(held) == 2 and all(t.untyped_storage().nbytes() == 96 for t in held)
    assert store.bytes_held == 192 and store.evictions == 1
    assert all(t.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr() for t in held)


def test_continued_step_records_own_their_rows():
    cache = StepCache(max_idle_calls=2)
    cache.begin_call()
    call_rows = torch.randn(20, 1, 2)
    cache.extend("Q\n", StepRecord("a\n", [1], call_rows[5:9]), [])
    assert cache.tensors()[0].untyped_storage().data_ptr() == call_rows.untyped_storage().data_ptr()
    cache.begin_call()
    (record,) = cache.history_for("Q\na\n")
    assert record.hidden.untyped_storage().nbytes() == 4 * 2 * 4  # a compact copy, not the call
    assert torch.equal(record.hidden, call_rows[5:9])


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


def _linear_history_for(entries: dict, prompt: str):
    """The step cache's rules by brute force over every key (the reference for its binary search)."""
    p, best, best_rank = prompt.rstrip(), None, None
    for key, entry in entries.items():  # insertion order: the first of equal ranks wins
        if p.startswith(key):
            rank = (len(key), 1, 0)
        elif key.startswith(p) and len(p) > entry.prompt_len:
            rank = (len(p), 0, -len(key))
        else:
            continue
        if best_rank is None or rank > best_rank:
            best, best_rank = key, rank
    return best


def test_step_cache_binary_search_agrees_with_a_scan_of_every_key():
    import random

    rng = random.Random(0)
    text = lambda n: "".join(rng.choice("ab \n") for _ in range(rng.randint(0, n)))  # noqa: E731
    for _ in range(300):
        cache = StepCache(rng.randint(1, 3))
        for _ in range(rng.randint(1, 4)):
            cache.begin_call()
            keys = list(cache._entries)
            prompts = [text(6) for _ in range(4)] + [k[: rng.randint(0, len(k) + 2)] + text(2) for k in keys[:4]]
            found = {}
            for p in prompts:
                want = _linear_history_for(cache._entries, p)
                history = cache.history_for(p)
                assert history == ([] if want is None else cache._entries[want].history)
                found[p] = history
            for p in prompts:
                cache.extend(p, StepRecord(text(4), [], torch.zeros(0)), found[p])
