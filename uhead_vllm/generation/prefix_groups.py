"""Which requests of one call share a prompt prefix, as vLLM's prefix cache will share it.

vLLM computes a shared prefix's KV once and serves it to every later request from its prefix
cache: whole prompts for the samples of one prompt, whole blocks across prompts (e.g. a chat
template's system prompt). The rows of those positions are then forwarded for one request only.
The worker's placer writes them into every request of the group instead (see
``RowDestination.groups``), so they need no copy from the row store after the pass.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .prefix_store import block_keys


def prefix_groups(prompts: Sequence[tuple[bytes, Sequence[int], Sequence[int]]], block_size: int
                  ) -> list[tuple[int, tuple[int, ...]]]:
    """Groups ``(limit, tags)`` of requests whose prompts agree on their first ``limit`` tokens.

    ``prompts``: per prompt ``(salt, token ids, request tags)``; a salt (steering) separates prompts
    that vLLM never shares KV between. Identical prompts (the samples of one prompt, or the same
    prompt twice) form one group over the whole prompt; prompts sharing full blocks form a group
    over those blocks, at the deepest block where the membership is still the same. The family is
    laminar (two groups are nested or disjoint) and deeper groups have longer limits.
    """
    same: dict[tuple[bytes, tuple[int, ...]], list[int]] = {}
    for salt, ids, tags in prompts:
        same.setdefault((salt, tuple(ids)), []).extend(tags)
    groups: list[tuple[int, tuple[int, ...]]] = [(len(ids), tuple(tags)) for (_, ids), tags in same.items()
                                                 if len(tags) > 1 and len(ids) > 0]
    by_key: dict[bytes, tuple[int, list[tuple[bytes, tuple[int, ...]]]]] = {}
    for prompt in same:
        salt, ids = prompt
        for depth, key in enumerate(block_keys(ids, block_size, len(ids) // block_size, salt)):
            by_key.setdefault(key, (depth, []))[1].append(prompt)
    seen = {frozenset(tags) for _, tags in groups}  # a whole-prompt group is deeper than its blocks
    for depth, members in sorted(by_key.values(), key=lambda v: -v[0]):  # deepest first
        if len(members) < 2:
            continue
        tags = tuple(t for prompt in members for t in same[prompt])
        if frozenset(tags) not in seen:
            seen.add(frozenset(tags))
            groups.append(((depth + 1) * block_size, tags))
    return groups


def credited_shared_rows(prompts: Sequence[Sequence[int]], num_rows: np.ndarray, cum: np.ndarray,
                         groups: Sequence[tuple[int, Sequence[int]]], rows: np.ndarray, matched: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Which prompt rows of grouped sequences hold a right row after the worker's shared writes.

    The worker wrote every row a request forwarded at a shared prompt position into the slot of
    every request sharing that prefix, in an order the caller does not know. The writers into
    sequence b's slot at position p are the members of the largest group of b whose limit is above
    p (the groups nest), so b's row there counts only if some member forwarded p and every row
    forwarded there carried the prompt's token (the same ids before it: the same computation).
    Positions at or past the prefix the members' prompts really share (should vLLM run other ids
    than the groups were built from) never count: a row of another prompt, or a generated one, may
    have landed there.

    ``prompts[k]`` / ``num_rows[k]``: sequence k's prompt as vLLM ran it and its row count;
    ``cum``: the sequences' first rows among all rows (length + 1); ``groups``: ``(limit, sequence
    indices)``; ``rows`` / ``matched``: the captured rows of the call's requests as indices among
    all rows and whether their token was right. Returns the grouped rows' indices among all rows
    and whether each counts. Index math over all groups at once (a call has hundreds).
    """
    total = int(cum[-1])
    # Inner groups first, outer ones take over the positions they cover (at an equal limit the
    # larger group is the outer one: its members all write into each other's slots there).
    order = sorted(range(len(groups)), key=lambda g: (-groups[g][0], len(groups[g][1])))
    limits = np.asarray([groups[g][0] for g in order], dtype=np.int64)
    sizes = np.asarray([len(groups[g][1]) for g in order], dtype=np.int64)
    member = np.asarray([k for g in order for k in groups[g][1]], dtype=np.int64)  # sequence per membership
    of = np.repeat(np.arange(len(order)), sizes)  # group per membership
    first = np.cumsum(sizes) - sizes  # each group's first membership
    start = np.concatenate(([0], np.cumsum(limits)))  # each group's (group, position) keys begin here
    # The prefix every group's prompts really share: the first position where a member differs
    # from the group's first member (at most the shortest prompt and the limit).
    plen = np.asarray([len(p) for p in prompts], dtype=np.int64)
    flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
    pstart = np.concatenate(([0], np.cumsum(plen)))[:-1]
    common = np.minimum(limits, np.minimum.reduceat(plen[member], first))
    span = common[of]  # positions to compare per membership
    m = np.repeat(np.arange(len(member)), span)
    pos = np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span)
    differs = flat[pstart[member[m]] + pos] != flat[pstart[member[first[of[m]]]] + pos]
    first_diff = span.copy()
    np.minimum.at(first_diff, m[differs], pos[differs])
    shared_to = np.minimum.reduceat(first_diff, first)
    # Per row of a grouped sequence its (group, position) key; the outermost group covering it wins.
    n = np.minimum(limits[of], num_rows[member])
    pos = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    row_of = np.repeat(cum[member], n) + pos
    key = np.repeat(start[of], n) + pos
    winner = np.full(total, -1, dtype=np.int64)
    np.maximum.at(winner, row_of, np.arange(len(key)))  # entries run inner to outer: the last one wins
    key_of = np.full(total, -1, dtype=np.int64)
    covered = winner >= 0
    key_of[covered] = key[winner[covered]]
    keys = key_of[rows]
    forwarded = np.zeros(int(start[-1]), dtype=bool)
    forwarded[keys[keys >= 0]] = True
    bad = np.zeros_like(forwarded)
    bad[keys[(keys >= 0) & ~matched]] = True
    targets = np.flatnonzero(covered)
    k = key_of[targets]
    group = np.repeat(np.arange(len(order)), limits)[k]
    good = forwarded[k] & ~bad[k] & (k - start[group] < shared_to[group])
    return targets, good
