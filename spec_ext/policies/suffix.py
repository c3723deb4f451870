"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from everything generated before.

:class:`SuffixCache` keeps the finished rows of earlier calls (their outputs, and their
prompts when ``prompts=True``) in suffix automata with occurrence counts. Each round a row
looks up the longest suffix of its text (at most ``max_match`` tokens) that occurred in the
stored texts followed by at least one token, and drafts a tree of that suffix's most
frequent continuations, grown best first by their empirical probability (the product, down
the path, of ``count(x + c) / count(x)``), nodes below ``min_prob`` left out, at most
``alpha * match length`` nodes (the paper's rule; vLLM's ``suffix_decoding_max_spec_factor``
and ``suffix_decoding_min_token_prob``). :func:`spec_ext.reference.reference_tree` is the same rule by a plain
scan of the stored texts, which the automata are tested against.

:class:`Suffix` is the policy: :class:`~spec_ext.policies.NGram`'s settings and the row's
own text, plus the cache; alone, a row drafts the cache's tree where its match is longer than
the own text's, else the own text's tree; beside a model, the round is ``Auto``'s with the
cache's tree as one more offer per row, valued by the accepted share measured for its kind of
match (:meth:`SuffixCache.expected`).

Memory is bounded by ``budget`` stored tokens: requests go into the newest of ``segments``
automata; once it holds ``budget / segments`` tokens a new one opens, and the oldest whole
segments (whole requests) are dropped while more than ``budget`` tokens are stored. The
stored tokens therefore stay between ``budget * (segments - 1) / segments`` and ``budget``
once that much was added, and nothing is ever rebuilt. One lock guards adds and lookups, so
threads calling ``generate`` at once may share a cache.
"""
from __future__ import annotations

import heapq
import threading
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from spec_ext.policies.base import Call, Controller, Offer, RoundState, TextLookup, check, register
from spec_ext.policies.ngram import NGram, TextSettings, _Lookup


class _Automaton:
    """A generalized suffix automaton of some requests: state 0 the root; ``count[s]`` the
    number of places (over all texts) where the strings of state s end."""

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.count = [-1], [0], [0]
        self.tokens = 0  # stored tokens (the version rows check their match against)
        self.requests: list[int] = []  # their ids
        self._ranked: dict[int, list[tuple[int, int]]] = {}  # state -> its children by count (until an add)

    def _state(self, length: int, link: int, count: int, transitions: dict[int, int]) -> int:
        self.next.append(transitions)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        return len(self.length) - 1

    def _clone(self, p: int, q: int, c: int) -> int:
        """Split q: a new state of length len(p) + 1 takes its shorter strings."""
        nxt, link, length = self.next, self.link, self.length
        clone = self._state(length[p] + 1, link[q], self.count[q], dict(nxt[q]))
        while p != -1 and nxt[p].get(c) == q:
            nxt[p][c] = clone
            p = link[p]
        link[q] = clone
        return clone

    def _extend(self, last: int, c: int) -> int:
        nxt, link, length = self.next, self.link, self.length
        q = nxt[last].get(c)
        if q is not None:  # the text so far already occurred: its state, split if it holds longer strings
            return q if length[q] == length[last] + 1 else self._clone(last, q, c)
        cur = self._state(length[last] + 1, 0, 0, {})
        p = last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            link[cur] = q if length[p] + 1 == length[q] else self._clone(p, q, c)
        return cur

    def add(self, request: int, text: Sequence[int]) -> None:
        link, count = self.link, self.count
        last = 0
        for c in text:
            last = s = self._extend(last, int(c))
            while s > 0:  # every suffix of the text so far ends here once more
                count[s] += 1
                s = link[s]
        self.tokens += len(text)
        self.requests.append(request)
        self._ranked.clear()

    def ranked(self, state: int) -> list[tuple[int, int]]:
        """State's children as (count, token), most frequent first (kept until the next add)."""
        ranked = self._ranked.get(state)
        if ranked is None:
            count = self.count
            ranked = self._ranked[state] = sorted(((count[t], c) for c, t in self.next[state].items()),
                                                  key=lambda x: (-x[0], x[1]))
        return ranked

    def walk(self, state: int, length: int, tokens: Sequence[int], most: int) -> tuple[int, int]:
        """The longest suffix (at most ``most`` tokens) that occurs, after reading ``tokens``
        on from (state, length)."""
        nxt, link, lengths = self.next, self.link, self.length
        for c in tokens:
            while state and c not in nxt[state]:
                state = link[state]
                length = lengths[state]
            if c in nxt[state]:
                state, length = nxt[state][c], length + 1
                if length > most:
                    length = most
                    while lengths[link[state]] >= most:
                        state = link[state]
            else:
                state, length = 0, 0
        return state, length

    def continued(self, state: int, length: int) -> int:
        """The longest suffix of the match that is followed by a token somewhere (its length)."""
        while state and not self.next[state]:
            state = self.link[state]
            length = self.length[state]
        return length if state else 0

    def state_of(self, state: int, length: int) -> int:
        """The state of the match's suffix of ``length`` tokens."""
        while self.length[self.link[state]] >= length:
            state = self.link[state]
        return state


class SuffixMatch:
    """One row's place in each of a cache's automata (kept in step with the row's text, whose
    token list the row's matcher owns); made by :meth:`SuffixCache.match`."""

    def __init__(self, history: list[int]):
        self.history = history
        self.places: dict[int, tuple[int, int, int, int]] = {}  # segment id -> (version, read, state, length)


class CacheTree(NamedTuple):
    """A row's tree from the cache (:meth:`SuffixCache.propose`)."""
    tokens: list[int]
    parents: list[int]
    match: int  # the match's length (0: none)
    score: float  # the sum of the nodes' probabilities
    probs: list[float]  # each node's probability (node 1 on, in order: best first, non-increasing)


class SuffixCache:
    """Finished requests' texts with counts, for suffix decoding (see the module docstring).

    Args:
        budget: most stored tokens (whole requests evicted, oldest first, past it).
        prompts: also store each request's prompt (an output quoting its prompt, or a prompt
            sent again, is found then); False: the outputs alone.
        segments: automata the budget is split over (eviction drops the oldest whole).
        max_match: the longest suffix looked up (tokens), as the paper's tree depth.

    Example:
        >>> cache = SuffixCache(budget=1000)
        >>> cache.add([1, 2], [3, 4, 5, 6]); cache.add([9], [3, 4, 5, 7])
        >>> tree = cache.propose(cache.match([8, 3, 4]), depth=4, nodes=8)
        >>> tree.tokens, tree.parents, tree.match, tree.score   # 5 always follows [3, 4]; then 6 or 7, one each
        ([-1, 5, 6], [-1, 0, 1], 2, 1.5)
    """

    def __init__(self, budget: int = 1_000_000, prompts: bool = True, segments: int = 4, max_match: int = 64):
        for name, value, least in (("budget", budget, 1), ("segments", segments, 1), ("max_match", max_match, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name}: must be an int >= {least}, got {value!r}")
        self.budget, self.prompts, self.max_match = budget, bool(prompts), max_match
        self.segment_tokens = max(1, budget // segments)
        self._segments: deque[_Automaton] = deque()
        self._ids: deque[int] = deque()  # each segment's id (a row's places are keyed by it)
        self._next_id = self._next_request = 0
        self._texts: dict[int, list[int]] = {}  # request id -> its stored text (for texts())
        self._lock = threading.Lock()
        # beside a model: per kind of match, (accepted, score) summed over the rounds that drafted it
        self._calibration: dict[tuple[str, int], tuple[float, float]] = {}

    def expected(self, kind: tuple[str, int], score: float) -> float:
        """The drafts a text tree of ``score`` and match ``kind`` (:func:`match_kind`) is expected
        to get accepted: ``score`` x the accepted share of the score over the earlier rounds of
        that kind (decayed; a prior of ``PRIOR_SHARE`` before any). The empirical probabilities
        of a match seen once are all 1: a short one's tree scores its size, yet is rarely
        accepted whole; this share is what the rounds measured."""
        accepted, scored = self._calibration.get(kind) or _prior(kind)
        return score * accepted / scored

    def calibrate(self, kind: tuple[str, int], accepted: int, score: float) -> None:
        """One round that drafted a text tree of ``score`` and match ``kind``: ``accepted`` drafts."""
        if score <= 0:
            return
        with self._lock:
            before_accepted, before_scored = self._calibration.get(kind) or _prior(kind)
            self._calibration[kind] = (CALIBRATION_DECAY * before_accepted + min(accepted, score),
                                       CALIBRATION_DECAY * before_scored + score)  # one assignment: readers take no lock

    @property
    def tokens(self) -> int:
        """Tokens stored now (at most ``budget``)."""
        return sum(s.tokens for s in self._segments)

    def texts(self) -> list[list[int]]:
        """The stored texts, oldest first (each a prompt then its output, or the output)."""
        with self._lock:
            return [list(t) for t in self._texts.values()]

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Store one finished request (a text longer than the budget is not stored)."""
        text = [int(t) for t in (list(prompt) + list(output) if self.prompts else output)]
        if not text or len(text) > self.budget:
            return
        with self._lock:
            if not self._segments or self._segments[-1].tokens >= self.segment_tokens:
                self._segments.append(_Automaton())
                self._ids.append(self._next_id)
                self._next_id += 1
            request = self._next_request
            self._next_request += 1
            self._segments[-1].add(request, text)
            self._texts[request] = text
            while self.tokens > self.budget:
                for r in self._segments.popleft().requests:
                    del self._texts[r]
                self._ids.popleft()

    def match(self, history: list[int]) -> SuffixMatch:
        """A row's matcher over ``history`` (the row's own token list, read as it grows)."""
        return SuffixMatch(history)

    def _places(self, match: SuffixMatch) -> list[tuple[_Automaton, int, int]]:
        """Per segment (automaton, state, length) of the row's longest match; brings the
        row's places up to date (a segment that changed since is walked again over the last
        ``max_match`` tokens, a new one too)."""
        history, most, places = match.history, self.max_match, {}
        for sid, automaton in zip(self._ids, self._segments):
            version, read, state, length = match.places.get(sid, (-1, 0, 0, 0))
            if version != automaton.tokens:
                read, state, length = max(0, len(history) - most), 0, 0
            state, length = automaton.walk(state, length, history[read:], most)
            places[sid] = (automaton.tokens, len(history), state, length)
        match.places = places
        return [(a, places[sid][2], places[sid][3]) for sid, a in zip(self._ids, self._segments)]

    def match_length(self, match: SuffixMatch) -> int:
        """The length of the row's longest suffix stored with a token after it (0: none); what
        :meth:`propose` would grow its tree from."""
        with self._lock:
            return max((a.continued(s, length) for a, s, length in self._places(match)), default=0)

    def propose(self, match: SuffixMatch, depth: int, nodes: int, alpha: float = 1.0,
                min_prob: float = 0.1) -> CacheTree:
        """The row's draft tree (tokens, parents, match length, score, each node's probability).

        tokens/parents as :func:`spec_ext.policies.continuation_tree` (node 0 the root, token
        -1; parents before children); at most ``min(nodes - 1, int(alpha * match length))``
        nodes past the root, none deeper than ``depth``, none of empirical probability below
        ``min_prob``; ``score`` the sum of the nodes' probabilities (the drafts expected to be
        accepted if the stored texts predict the row). The root alone and 0 when nothing matches.
        """
        with self._lock:
            places = self._places(match)
            n = max((a.continued(s, length) for a, s, length in places), default=0)
            if n == 0:
                return CacheTree([-1], [-1], 0, 0.0, [])
            start = [(a, a.state_of(s, n)) for a, s, length in places if length >= n]
            tokens, parents, score, probs = _best_first(start, depth, min(nodes - 1, int(alpha * n)), min_prob)
            return CacheTree(tokens, parents, n, score, probs)


def _best_first(start, depth: int, most: int, min_prob: float) -> tuple[list[int], list[int], float, list[float]]:
    """Grow the tree from the places ``start`` [(automaton, state)] of the match, best first:
    (tokens, parents, score, each node's probability). Ties go to the earlier parent, then the
    smaller token."""
    tokens, parents, score, probs = [-1], [-1], 0.0, []
    heap: list = []

    def push(places, prob: float, parent: int, level: int) -> None:
        total = sum(a.count[s] for a, s in places)
        # a child of probability >= min_prob has, in one of the places at least, a count of
        # its share of the bound: only those tokens are summed (most frequent first)
        least = min_prob * total / prob / len(places) * (1 - 1e-9)
        candidates = set()
        for a, s in places:
            for count, c in a.ranked(s):
                if count < least:
                    break
                candidates.add(c)
        for c in sorted(candidates):
            child = [(a, a.next[s][c]) for a, s in places if c in a.next[s]]
            p = prob * sum(a.count[t] for a, t in child) / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, parent, c, level, child))

    push(start, 1.0, 0, 1)
    while heap and len(tokens) <= most:
        p, parent, c, level, child = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(c)
        parents.append(parent)
        probs.append(-p)
        score -= p
        if level < depth:
            push(child, -p, node, level + 1)
    return tokens, parents, score, probs


# the accepted share of a text tree's score before any round of its kind measured it, by
# (source, match length bucket): short matches seen once score their size yet rarely hold
PRIOR_SHARE = {("cache", 1): 0.25, ("cache", 4): 0.4, ("cache", 8): 0.6, ("cache", 16): 0.8,
               ("cache", 32): 0.9}
PRIOR_WEIGHT = 8.0  # the prior counts as this much score
CALIBRATION_DECAY = 0.97  # the cache's, per round of the kind: the share follows the workload


def match_kind(n: int) -> tuple[str, int]:
    """The kind a cache tree's calibration is kept by: its match length by powers of two
    (1-3, 4-7, 8-15, 16-31, 32+)."""
    return "cache", next(b for b in (32, 16, 8, 4, 1) if n >= b)


def _prior(kind: tuple[str, int]) -> tuple[float, float]:
    return PRIOR_SHARE.get(kind, 0.3) * PRIOR_WEIGHT, PRIOR_WEIGHT


@register
@dataclass(frozen=True)
class Suffix(NGram):
    """Suffix decoding: :class:`NGram` (the row's own text) plus a :class:`SuffixCache` of
    earlier requests (shared across calls and threads; ``generate`` adds each finished row to
    it after the call).

    Alone, each round a row drafts the cache's tree where the cache's match is longer than
    its own text's (the own text's tree otherwise), grown by the paper's rule
    (:meth:`SuffixCache.propose`: best first by empirical probability, at most ``alpha`` x
    match length nodes, none below ``min_prob``), at most ``cache_nodes`` nodes while one row
    is going (a repeat's continuation is accepted whole: a verification of 64 tokens costs
    about 1.5 of 32 on the bundled target), the own text's budget with more rows. Drafts are
    deterministic (one-hot q): exact at every temperature.

    Beside a model (a draft model, a feature head), the round is :class:`Auto`'s, with the
    cache's tree as one more offer of each row: valued at its nodes' probabilities times the
    accepted share measured for its kind of match (:meth:`SuffixCache.expected`, kept in the
    cache across calls: a short match seen once scores its size yet is rarely accepted
    whole), and cut to the width that pays, against the row's own text chain and the model's
    chain (``docs/suffix.md``).

    Args:
        cache: the :class:`SuffixCache` (None: a new one).
        alpha, min_prob: the paper's size factor and probability floor (vLLM's defaults 1.0, 0.1).
        min_score: the least score (sum of node probabilities) of a cache tree a row drafts
            (None: any).
        own_text: also draft from the row's own text (NGram's matcher; None: yes).
        max_depth: the deepest a cache tree goes (None: as deep as its node budget).
        cache_nodes: the most nodes (root included) of a cache tree while one row is going.
        **NGram's settings (trees only).

    Example:
        >>> cache = SuffixCache(budget=1_000_000)
        >>> out = spec_ext.generate(target, None, ids, policy=Suffix(cache))   # doctest: +SKIP
        >>> out.stats.cache_matched                                             # doctest: +SKIP
    """
    cache: SuffixCache | None = None
    alpha: float = 1.0
    min_prob: float = 0.1
    min_score: float | None = None
    own_text: bool | None = None
    max_depth: int | None = None
    cache_nodes: int = 64

    def __post_init__(self):
        super().__post_init__()
        check(self.tree, "tree", "Suffix drafts trees (tree=True)")
        check(self.cache is None or isinstance(self.cache, SuffixCache), "cache",
              f"expected a SuffixCache, got {type(self.cache).__name__}")
        check(self.alpha > 0 and 0 <= self.min_prob <= 1, "alpha, min_prob",
              f"need alpha > 0 and 0 <= min_prob <= 1, got {self.alpha}, {self.min_prob}")
        check(self.max_depth is None or (isinstance(self.max_depth, int) and self.max_depth >= 1), "max_depth",
              f"need an int >= 1 or None, got {self.max_depth!r}")
        check(isinstance(self.cache_nodes, int) and not isinstance(self.cache_nodes, bool) and self.cache_nodes >= 2,
              "cache_nodes", f"need an int >= 2, got {self.cache_nodes!r}")
        if self.cache is None:
            object.__setattr__(self, "cache", SuffixCache())

    @property
    def max_draft(self) -> int:
        return max(super().max_draft, self.cache_nodes - 1, 12)

    def text_settings(self, has_model: bool) -> TextSettings:
        return TextSettings(self.n_max, self.n_min, self.max_continuations, self.cache, self.alpha, self.min_prob)

    def start(self, call: Call) -> Controller:
        if call.draft is None:
            return _SuffixLookup(self, call)
        from spec_ext.policies.auto import Auto, AutoController
        return AutoController(Auto(max_draft=max(self.draft_k, 12), text=self.own_text is not False), call, self)

    def cache_offer(self, text: TextLookup, row: int, rows: int, longer_than: int = 0) -> Offer | None:
        """Row ``row``'s cache tree with ``rows`` rows going (at most ``cache_nodes`` nodes at one
        row, the own text's budget with more, none deeper than ``max_depth``), where the cache's
        match is longer than ``longer_than`` and the tree scores at least ``min_score``; else None."""
        if text.cache_match(row) <= longer_than:
            return None
        nodes = self.cache_nodes if rows == 1 else max(2, min(self.max_nodes, self.round_tokens // rows))
        offer = text.cache_tree(row, nodes - 1 if self.max_depth is None else min(self.max_depth, nodes - 1), nodes)
        return offer if offer is not None and sum(offer.probs) >= (self.min_score or 0.0) else None


class _SuffixLookup(_Lookup):
    """:class:`Suffix` alone: per row the cache's tree where its match is longer than the own
    text's, else the own text's tree."""

    def offers(self, state: RoundState) -> list[Offer | None]:
        own = super().offers(state) if self.policy.own_text is not False else [None] * len(self.depth)
        return [self.policy.cache_offer(state.text, r, state.rows, 0 if o is None else o.match) or o
                for r, o in enumerate(own)]
