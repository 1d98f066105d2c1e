"""Which requests of one call share a prompt prefix, as vLLM's prefix cache will share it.

vLLM computes a shared prefix's KV once and serves it to every later request from its prefix
cache: whole prompts for the samples of one prompt, whole blocks across prompts (e.g. a chat
template's system prompt). The rows of those positions are then forwarded for one request only.
The worker's placer writes them into every request of the group instead (see
``RowDestination.groups``), so they need no copy from the row store after the pass.
"""

from __future__ import annotations

from typing import Sequence


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


def groups_within_slots(groups: Sequence[tuple[int, tuple[int, ...]]], slots: dict[int, tuple[int, int]]
                        ) -> list[tuple[int, tuple[int, ...]]]:
    """``groups`` (of :func:`prefix_groups`) as a ``RowDestination`` takes them: each limit cut to
    its members' slot capacities (``slots[tag] = (first row, capacity)``: rows past a slot are never
    written), groups left with no row dropped."""
    cut = [(min([limit] + [slots[t][1] for t in tags]), tags) for limit, tags in groups]
    return [(limit, tags) for limit, tags in cut if limit > 0]
