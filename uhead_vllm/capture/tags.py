"""Which live vLLM request carries which capture tag, inside the worker.

A request's tag arrives in ``SamplingParams.extra_args`` when vLLM schedules it for the first time
(:class:`~.protocol.RequestTag`) and is forgotten when vLLM reports it finished. Nothing a client
sends may stop the engine: a tag that does not parse is counted and its request runs untagged, and
so is one the engine side did not announce (while a generation writes into a destination, only the
destination's slots are announced). A second live request with the same tag and sample keeps
running untagged too, so the first one's rows stay its own; that one is reported with the next
take, since it is what sampling with n>1 outside the generator does.

A tag's ``start`` opens a capture window: rows at positions below it are not recorded. The book
keeps the live requests whose window is not reached yet (usually none: then a step costs nothing
more) and tells, per step, how many leading rows of each one's chunk lie below its start.
"""

from __future__ import annotations

from .protocol import RequestTag

_UNKNOWN = object()  # a request id the book never saw


class TagBook:
    """Tags of the live requests, by vLLM request id, and counts of the tags refused."""

    def __init__(self) -> None:
        self._tags: dict[str, RequestTag | None] = {}
        self._untagged = 0  # live requests in ``_tags`` without a tag
        self._owner: dict[tuple[int, int], str] = {}
        self.windows: dict[str, int] = {}  # live requests whose window start is not reached yet -> start
        self.announced: set[int] | None = None  # tags the engine side announced (None: any well-formed tag)
        self.malformed = 0  # requests whose tag did not parse (they ran untagged)
        self.unannounced = 0  # requests whose tag the engine side had not announced (they ran untagged)
        self.duplicates = 0  # requests whose tag and sample a live request already had (they ran untagged)

    def counters(self) -> dict[str, int]:
        """The refused tags since the worker started (for ``uhead_status``)."""
        return {"tags_malformed": self.malformed, "tags_unannounced": self.unannounced,
                "tags_duplicate": self.duplicates}

    def get(self, req_id: str) -> RequestTag | None:
        """The request's tag (None: untagged or unknown)."""
        return self._tags.get(req_id)

    def finished(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self.windows.pop(rid, None)
            tag = self._tags.pop(rid, _UNKNOWN)
            if tag is None:
                self._untagged -= 1
            elif isinstance(tag, RequestTag) and self._owner.get((tag.tag, tag.sample)) == rid:  # not _UNKNOWN
                del self._owner[(tag.tag, tag.sample)]

    def register(self, req_id: str, extra_args: dict | None) -> str | None:
        """Record a newly scheduled request's tag; returns a problem to report with the next take
        (a tag two live requests carry), else None. Never raises."""
        try:
            tag = RequestTag.from_extra_args(extra_args)
        except ValueError:  # forged or damaged: the request runs untagged
            self.malformed += 1
            tag = None
        if tag is not None and self.announced is not None and tag.tag not in self.announced:
            self.unannounced += 1
            tag = None
        problem = None
        if tag is not None:
            key = (tag.tag, tag.sample)
            other = self._owner.get(key)
            if other is not None and other != req_id:
                self.duplicates += 1
                problem = (f"requests {other!r} and {req_id!r} carry the same capture tag {key}: sampling with "
                           "n>1 must go through VllmHiddenStatesGenerator, which gives every sample its own tag")
                tag = None  # the first keeps its rows
            else:
                self._owner[key] = req_id
        if self._tags.get(req_id, _UNKNOWN) is None:
            self._untagged -= 1  # registered again (a request id reused)
        self._tags[req_id] = tag
        if tag is None:
            self._untagged += 1
            self.windows.pop(req_id, None)
        elif tag.start:
            self.windows[req_id] = tag.start
        return problem

    def resumed(self, req_ids: set[str]) -> None:
        """Requests vLLM resumed after a preemption compute from the start again: windows reopen."""
        for rid in req_ids:
            tag = self._tags.get(rid)
            if tag is not None and tag.start:
                self.windows[rid] = tag.start

    def below_windows(self, scheduled: dict[str, int], computed: dict[str, int]) -> dict[str, int]:
        """Per request of this step with rows below its window start, how many of its leading rows
        are (``scheduled``: tokens this step; ``computed``: tokens before it, 0 where unknown).
        Requests whose window this step reaches leave the book's pending windows."""
        below, reached = {}, []
        for rid, start in self.windows.items():
            n = scheduled.get(rid)
            if not n:
                continue
            first = computed.get(rid, 0)
            if start > first:
                below[rid] = min(start - first, n)
            if first + n >= start:
                reached.append(rid)
        for rid in reached:
            del self.windows[rid]
        return below

    def scheduled_rows(self, scheduled: dict[str, int]) -> int:
        """Rows of tagged requests among ``scheduled`` (request id -> tokens this step)."""
        tags = self._tags
        if not self._untagged and scheduled.keys() <= tags.keys():
            return sum(scheduled.values())  # every request is captured: no lookup per request
        if self._untagged == len(tags):
            return 0  # no live request is captured (plain traffic on a capturing engine)
        return sum(n for rid, n in scheduled.items() if tags.get(rid) is not None)

    def forget(self, tags: set[int]) -> None:
        """Stop recording the live requests that carry one of ``tags`` (a client that went away)."""
        for rid, tag in list(self._tags.items()):
            if tag is not None and tag.tag in tags:
                self.windows.pop(rid, None)
                self._tags[rid] = None
                self._untagged += 1
                if self._owner.get((tag.tag, tag.sample)) == rid:
                    del self._owner[(tag.tag, tag.sample)]
