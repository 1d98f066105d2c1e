"""The placer's lookup tables for a destination's prefix groups (see :class:`~.destination.RowDestination`).

Requests whose prompts agree on their first ``limit`` tokens form a group ``(limit, tags)``; the
groups of one destination are a laminar family (two groups are nested or disjoint, the smaller one
with the longer limit). The tables describe them as nested member ranges, so the placer finds with
numpy index arithmetic, per row, the slots of the other members it must also be written into
(placer.py). Sizes grow with tags x nesting depth, never tags x group size, so one group of
thousands of requests (a shared system prompt) stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class GroupTables:
    """Each group's members are contiguous in ``member_first`` (the slots' first rows in that
    order). Per grouped tag (row ``group_row[tag]``; the last row: no group) its groups outer to
    inner with their limits (-1 / int64 max padding) and its own index in ``member_first``."""

    group_row: dict[int, int] = field(init=False, repr=False)
    chain: np.ndarray = field(init=False, repr=False)  # [T + 1, D] group ids
    chain_limit: np.ndarray = field(init=False, repr=False)  # [T + 1, D]
    reach: np.ndarray = field(init=False, repr=False)  # [T + 1] limit of the deepest group (0: none)
    member_index: np.ndarray = field(init=False, repr=False)  # [T + 1]
    member_first: np.ndarray = field(init=False, repr=False)  # [T]
    member_start: np.ndarray = field(init=False, repr=False)  # [T] each member's capture window start
    group_span: np.ndarray = field(init=False, repr=False)  # [G, 2] member range of each group

    def build_group_tables(self, slots: dict[int, tuple[int, int]], groups: list[tuple[int, tuple[int, ...]]],
                           starts: dict[int, int] | None = None) -> None:
        """Fill the tables for ``groups`` over ``slots`` (tag -> first row, capacity) and ``starts``
        (tag -> first position of its capture window; 0 where absent: no row below it is shared to it); refuses
        groups that are not laminar or whose members' slots are shorter than the group's limit."""
        ordered = sorted(groups, key=lambda g: (g[0], -len(g[1])))  # outer (shorter limit, larger) first
        chains: dict[int, list[int]] = {}
        for g, (limit, tags) in enumerate(ordered):
            if any(t not in slots or slots[t][1] < limit for t in tags):
                raise ValueError(f"prefix group {tags}: every member needs a slot of at least {limit} rows")
            parents = {chains[t][-1] if t in chains else -1 for t in tags}  # the group around each member
            parent = parents.pop() if len(parents) == 1 else None
            twice = parent is not None and parent >= 0 and len(ordered[parent][1]) == len(tags)
            if len(set(tags)) != len(tags) or parent is None or twice:
                raise ValueError(f"prefix group {tags}: groups must be nested or disjoint, an inner group's "
                                 "limit at least that of the group around it")
            for t in tags:
                chains.setdefault(t, []).append(g)
        members = sorted(chains, key=lambda t: chains[t])  # every group's members become contiguous
        depth = max((len(c) for c in chains.values()), default=0)
        self.group_row = {t: k for k, t in enumerate(members)}
        self.chain = np.full((len(members) + 1, depth), -1, dtype=np.int64)
        self.chain_limit = np.full((len(members) + 1, depth), np.iinfo(np.int64).max, dtype=np.int64)
        for k, t in enumerate(members):
            self.chain[k, : len(chains[t])] = chains[t]
            self.chain_limit[k, : len(chains[t])] = [ordered[g][0] for g in chains[t]]
        self.reach = np.asarray([ordered[chains[t][-1]][0] for t in members] + [0], dtype=np.int64)
        self.member_index = np.arange(len(members) + 1, dtype=np.int64)
        self.member_index[-1] = -1
        self.member_first = np.asarray([slots[t][0] for t in members], dtype=np.int64)
        self.member_start = np.asarray([(starts or {}).get(t, 0) for t in members], dtype=np.int64)
        self.group_span = np.zeros((len(ordered), 2), dtype=np.int64)
        for g, (_, tags) in enumerate(ordered):
            at = sorted(self.group_row[t] for t in tags)
            self.group_span[g] = (at[0], at[-1] + 1)
