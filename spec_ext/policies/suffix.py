"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from everything generated before.

:class:`SuffixCache` keeps the finished rows of earlier calls (their outputs, and their
prompts when ``prompts=True``) in suffix automata with occurrence counts. Each round a row
looks up the longest suffix of its text (at most ``max_match`` tokens) that occurred in the
stored texts followed by at least one token, and drafts a tree of that suffix's most
frequent continuations, grown best first by their empirical probability (the product, down
the path, of ``count(x + c) / count(x)``), nodes below ``min_prob`` left out, at most
``alpha * match length`` nodes (the paper's rule; vLLM's ``suffix_decoding_max_spec_factor``
and ``suffix_decoding_min_token_prob``). :func:`reference_tree` is the same rule by a plain
scan of the stored texts, which the automata are tested against.

:class:`Suffix` is the policy: :class:`~spec_ext.policies.NGram`'s settings and the row's
own text (today's matcher), plus the cache; a row drafts the cache's tree where its match is
longer than the own text's, else the own text's tree. Beside a draft model or a head, a row
drafts that tree only where it is expected to get more accepted than the model (the tree's
score times the accepted share measured for its kind of match, against the model's running
mean per row; :meth:`Suffix.measured_choice`). Greedy beside a head, once rounds are timed, the
round's width is priced too (:meth:`Suffix.priced`): trees are cut to the width whose expected
tokens per second of the round, at the verification's timed cost by width, is the highest.

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
from typing import Sequence

from spec_ext.policies.base import register
from spec_ext.policies.ngram import NGram
from spec_ext.policies.rules import Auto


def reference_tree(texts: Sequence[Sequence[int]], history: Sequence[int], depth: int, nodes: int,
                   alpha: float = 1.0, min_prob: float = 0.1, max_match: int = 64
                   ) -> tuple[list[int], list[int], int, float]:
    """What :meth:`SuffixCache.propose` returns, by a plain scan of the stored ``texts``: the
    longest suffix of ``history`` (at most ``max_match`` tokens) that occurs in a text with a
    token after it, then its continuations best first by ``count(x + c) / count(x)`` (counts
    of occurrences over all texts).

    Example:
        >>> reference_tree([[1, 2, 3, 4, 5, 6], [9, 3, 4, 5, 7]], [8, 3, 4], depth=4, nodes=8)
        ([-1, 5, 6], [-1, 0, 1], 2, 1.5)
    """
    def count(x: tuple) -> int:
        return sum(tuple(t[e - len(x):e]) == x for t in texts for e in range(len(x), len(t) + 1))

    def followed(x: tuple) -> bool:
        return any(tuple(t[e - len(x):e]) == x for t in texts for e in range(len(x), len(t)))

    L = len(history)
    n = next((m for m in range(min(max_match, L), 0, -1) if followed(tuple(history[L - m:]))), 0)
    if n == 0:
        return [-1], [-1], 0, 0.0
    vocabulary = sorted({c for t in texts for c in t})
    tokens, parents, score, heap = [-1], [-1], 0.0, []

    def push(path: tuple, prob: float, parent: int) -> None:
        total = count(path)
        for c in vocabulary:
            p = prob * count(path + (c,)) / total
            if p > 0 and p >= min_prob:
                heapq.heappush(heap, (-p, parent, c, path + (c,)))

    push(tuple(history[L - n:]), 1.0, 0)
    while heap and len(tokens) <= min(nodes - 1, int(alpha * n)):
        p, parent, c, path = heapq.heappop(heap)
        tokens.append(c)
        parents.append(parent)
        score -= p
        if len(path) - n < depth:
            push(path, -p, len(tokens) - 1)
    return tokens, parents, n, score


class _Automaton:
    """A generalized suffix automaton of some requests: state 0 the root; ``count[s]`` the
    number of places (over all texts) where the strings of state s end."""

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.count = [-1], [0], [0]
        self.tokens = 0  # stored tokens (the version rows check their match against)
        self.requests: list[tuple[int, int]] = []  # (request id, its tokens)
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
        self.requests.append((request, len(text)))
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
        self.node_probs: list[float] = []  # the last proposed tree's nodes' probabilities (node 1 on)


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
        >>> tokens, parents, n, score = cache.propose(cache.match([8, 3, 4]), depth=4, nodes=8)
        >>> tokens, parents, n, score   # 5 always follows [3, 4]; then 6 or 7, one each
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
                for r, _ in self._segments.popleft().requests:
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
                min_prob: float = 0.1) -> tuple[list[int], list[int], int, float]:
        """The row's draft tree: (tokens, parents, match length, score).

        tokens/parents as :func:`spec_ext.policies.continuation_tree` (node 0 the root, token
        -1; parents before children); at most ``min(nodes - 1, int(alpha * match length))``
        nodes past the root, none deeper than ``depth``, none of empirical probability below
        ``min_prob``; ``score`` the sum of the nodes' probabilities (the drafts expected to be
        accepted if the stored texts predict the row). The root alone and 0 when nothing matches.
        Each node's probability (node 1 on, in order: best first, non-increasing) is left in
        ``match.node_probs`` (what :meth:`Suffix.priced` cuts a tree by).
        """
        with self._lock:
            places = self._places(match)
            n = max((a.continued(s, length) for a, s, length in places), default=0)
            if n == 0:
                match.node_probs = []
                return [-1], [-1], 0, 0.0
            start = [(a, a.state_of(s, n)) for a, s, length in places if length >= n]
            tokens, parents, score, match.node_probs = _best_first(start, depth,
                                                                   min(nodes - 1, int(alpha * n)), min_prob)
            return tokens, parents, n, score


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


# beside a draft model or a head: the model's accepted drafts per round assumed before a row
# measured its own (the bundled head's rounds accept about this many on the bundled pair)
BESIDE_MIN_SCORE = 2.0
# the accepted share of a text tree's score before any round of its kind measured it, by
# (source, match length bucket): short matches seen once score their size yet rarely hold
PRIOR_SHARE = {("own", 0): 0.5, ("cache", 1): 0.25, ("cache", 4): 0.4, ("cache", 8): 0.6, ("cache", 16): 0.8,
               ("cache", 32): 0.9}
PRIOR_WEIGHT = 8.0  # the prior counts as this much score
CACHE_OVER_HEAD = 1.5  # Suffix.cache_adds: a round is suffix decoding's where a cache tree is expected to get this
# many times the head chain's accepted drafts (at 1.0, matches of 4-6 tokens seen once (4-6 drafts, 0.4 of them
# expected) took rounds from the default on new requests and drafted no cache tree: the rule took the head)
CALIBRATION_DECAY = 0.97  # the cache's, per round of the kind: the share follows the workload
OWN_DECAY = 0.8  # a row's own text's, per round it drafted it (a row repeats itself or not: it shows soon)


def match_kind(from_cache: bool, n: int) -> tuple[str, int]:
    """The kind a text tree's calibration is kept by: its source and its match length (the
    own text's n-gram length; the cache's by powers of two: 1-3, 4-7, 8-15, 16-31, 32+)."""
    if not from_cache:
        return "own", max(1, min(n, 2))
    return "cache", next(b for b in (32, 16, 8, 4, 1) if n >= b)


def node_shares(tree: tuple[Sequence[int], Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[float]:
    """Each node's probability (node 1 on) in a tree of the row's own text
    (:func:`~spec_ext.policies.continuation_tree` of ``continuations``): the share of the
    continuations through it; their sum is the tree's score.

    Example:
        >>> node_shares(([-1, 5, 9, 6, 7], [-1, 0, 0, 1, 3]), [[5, 6, 7], [5, 6, 8], [9]])
        [0.6666666666666666, 0.3333333333333333, 0.6666666666666666, 0.3333333333333333]
    """
    tokens, parents = tree
    children: dict[tuple[int, int], int] = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    count = [0] * len(tokens)
    for sequence in continuations:
        node = 0
        for token in sequence:
            node = children.get((node, int(token)))
            if node is None:  # past the tree's nodes (cut by its budget)
                break
            count[node] += 1
    return [c / max(1, len(continuations)) for c in count[1:]]


def best_nodes(tree: tuple[Sequence[int], Sequence[int]], probs: Sequence[float], m: int
               ) -> tuple[list[int], list[int]]:
    """The root and the ``m`` nodes of ``tree`` (tokens, parents; parents before children) of
    highest probability (``probs``: node 1 on; ties: the earlier node), renumbered in their
    order. A node is never likelier than its parent, so the kept nodes hold their parents (the
    ancestors of a kept node are kept in any case).

    Example:
        >>> best_nodes(([-1, 5, 9, 6, 7], [-1, 0, 0, 1, 3]), [0.6, 0.4, 0.6, 0.3], 2)
        ([-1, 5, 6], [-1, 0, 1])
    """
    tokens, parents = tree
    ranked = sorted(range(1, len(tokens)), key=lambda i: (-probs[i - 1], i))[:max(0, m)]
    kept = set(ranked)
    for i in ranked:
        while parents[i] > 0 and parents[i] not in kept:
            i = parents[i]
            kept.add(i)
    order = sorted(kept)
    renumber = {0: 0}
    for new, old in enumerate(order, start=1):
        renumber[old] = new
    return [-1] + [int(tokens[i]) for i in order], [-1] + [renumber[parents[i]] for i in order]


def modeled_draft_cost(target, draft) -> float:
    """One draft forward's cost in target verifications, modeled (deterministic, not timed): the
    smaller of the draft's share of the target's parameters (a step that reads its weights) and
    of its layers (a small model's step on CPU, where each layer's kernels cost their launch)."""
    def count(model) -> int:
        return sum(p.numel() for p in model.parameters())

    def layers(model) -> int | None:
        found = getattr(model, "num_layers", None)
        if isinstance(found, int):
            return found
        config = getattr(model, "config", None)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return getattr(config, "num_hidden_layers", None)

    shares = []
    if count(target):
        shares.append(count(draft) / count(target))
    if layers(draft) and layers(target):
        shares.append(layers(draft) / layers(target))
    return min(shares, default=0.0)


WIDTH_PULL = 3.0  # width_costs: how many (decayed) measurements the line through all widths is worth at each
# width_costs: before the widths measured spread, a token's cost is this share of a verification's mean (Auto's
# one-width rule: +5% per token); the prior is worth SLOPE_PULL weighted squared tokens of spread (3 measurements
# 10 tokens from the mean)
SLOPE_PRIOR, SLOPE_PULL = 0.05, 300.0


def width_costs(widths: dict[int, Sequence[float]], widest: int) -> list[float]:
    """Seconds of a round verifying each width 0..``widest`` (index = width; 0 unused), from
    :class:`~spec_ext.policies.Auto`'s timed rounds by width (``widths``: width -> [decayed
    count, decayed seconds], its ``timed_widths()``), computed once for every width: a measured width's
    mean shrunk toward the weighted least-squares line through all measured widths, worth
    ``WIDTH_PULL`` measurements, so that a width measured once, on a stall, reads mostly the
    line and one measured every round mostly its own mean; a width not measured reads the line;
    never below half the cheapest measured. The line's slope (>= 0: a wider verification never
    costs less) is shrunk toward ``SLOPE_PRIOR`` of the mean per token, worth ``SLOPE_PULL``
    of the widths' weighted squared spread: on a loaded machine a few narrow widths' means
    differ by their stalls, and the line through them alone, extrapolated to 32 tokens, was
    measured at 4-7x the real cost. One width measured: +5% of it per token (Auto's rule).
    Empty: all zero (nothing known).

    Example:
        >>> [round(x, 2) for x in width_costs({2: [1.0, 1.0], 10: [1.0, 2.0]}, 10)[1:]]  # once each
        [1.1, 1.14, 1.26, 1.34, 1.42, 1.5, 1.58, 1.66, 1.74, 1.86]
        >>> [round(x, 2) for x in width_costs({2: [8.0, 8.0], 10: [8.0, 16.0]}, 10)[1:]]  # 8 times each
        [1.01, 1.03, 1.21, 1.3, 1.4, 1.5, 1.6, 1.7, 1.79, 1.97]
        >>> round(width_costs({2: [1.0, 1.0], 6: [1.0, 3.0], 10: [1.0, 2.0]}, 10)[6], 2)  # a stall at 6, once
        2.25
    """
    seen = {w: (n, s / n) for w, (n, s) in widths.items() if n > 1e-6}
    if not seen:
        return [0.0] * (widest + 1)
    floor = 0.5 * min(v for _, v in seen.values())
    if len(seen) == 1:
        (w0, (_, v0)), = seen.items()
        return [v0 * max(0.5, 1 + 0.05 * (w - w0)) for w in range(widest + 1)]
    total = sum(n for n, _ in seen.values())
    mean_w = sum(n * w for w, (n, _) in seen.items()) / total
    mean_v = sum(n * v for n, v in seen.values()) / total
    var = sum(n * (w - mean_w) ** 2 for w, (n, _) in seen.items())
    covariance = sum(n * (w - mean_w) * (v - mean_v) for w, (n, v) in seen.items())
    slope = max(0.0, (covariance + SLOPE_PULL * SLOPE_PRIOR * mean_v) / (var + SLOPE_PULL))
    out = []
    for w in range(widest + 1):
        line = mean_v + slope * (w - mean_w)
        if w in seen:
            n, v = seen[w]
            line = (n * v + WIDTH_PULL * line) / (n + WIDTH_PULL)
        out.append(max(line, floor))
    return out


def _leading(path: Sequence[int], nodes) -> int:
    """How many of ``path``'s first nodes are among ``nodes``."""
    nodes, held = set(nodes), 0
    for node in path:
        if node not in nodes:
            break
        held += 1
    return held


def _prior(kind: tuple[str, int]) -> tuple[float, float]:
    return PRIOR_SHARE.get(kind, 0.3) * PRIOR_WEIGHT, PRIOR_WEIGHT


EXPLORE_EVERY = 8  # Suffix.priced: every this many priced rounds, one at the widest width (kept measured)


@register
class Suffix(NGram):
    """Suffix decoding: :class:`NGram` (the row's own text, today's matcher) plus a
    :class:`SuffixCache` of earlier requests; each round a row drafts the cache's tree where
    the cache's match is longer than its own text's (the own text's tree otherwise), grown by
    the paper's rule (:meth:`SuffixCache.propose`: best first by empirical probability, at most
    ``alpha`` x match length nodes, none below ``min_prob``) within :meth:`cache_nodes`.
    Drafts are deterministic (one-hot q): exact at every temperature. ``generate`` adds each
    finished row to the cache after the call.

    Beside a draft model or a head (``min_score`` None), a row drafts its text tree only where
    the tree is expected to get more drafts accepted than the model's chain: the tree's score
    times the accepted share of the score measured so far for its kind of match
    (:meth:`SuffixCache.expected`, kept in the cache across calls: a short match seen once
    scores its size, yet is rarely accepted whole) against the model's accepted drafts per
    round, a running mean per row (``BESIDE_MIN_SCORE`` before the row measured one). Greedy
    beside a feature head, once rounds are timed (``price_width``), each round then chooses
    what every row verifies by expected tokens per second of the round, the verification
    priced at its timed cost by width (:meth:`priced`).

    Args:
        cache: the :class:`SuffixCache` (shared across calls and threads); None: a new one.
        alpha, min_prob: the paper's size factor and probability floor (vLLM's defaults 1.0, 0.1).
        min_score: a fixed rule instead: a row drafts from the text (cache or own) only where its
            tree's score is at least this; beside a draft model or a head the other rows are
            drafted by the model. None: alone 0 (every match); beside a model the measured
            rule above.
        own_text: also draft from the row's own text (NGram's matcher). None: yes, except beside
            a model under a fixed ``min_score`` (its one- and two-token matches would take rows
            from the model unmeasured).
        model_memory: the weight of a row's earlier rounds in the model's running mean (each
            round it drafted: mean = memory * mean + (1 - memory) * accepted).
        max_depth: the deepest a cache tree goes (None: as deep as its node budget,
            :meth:`cache_nodes`; the paper's rule sizes it: a 64-token match of a request seen
            before drafts a chain of 63 at batch 1). The own text's trees keep NGram's ``k``.
        cache_nodes: the most nodes (root included) of a cache tree while one row is going: a
            long match of an earlier request is accepted whole, and at batch 1 a verification of
            64 tokens costs about 1.5 of 32 on the bundled target (27 and 18 ms against 8 ms for
            one token, HF's forward, 1 thread), so a repeat drafts its continuation in half the
            rounds (measured: the benchmark's repeated requests 11-20% faster). With more rows a
            row's cache tree keeps the own text's budget (``round_tokens // B``): the
            verification pads every row to the widest tree, and 8 nodes a row at B=8 was 2-4%
            slower than 4. The own text's trees keep NGram's budget at every batch size.
        draft_cost: one draft forward's cost in target verifications (what a round where the
            model drafts costs more: ``draft_k`` of them). None: :func:`modeled_draft_cost`.
        branch_nodes: greedy, beside a feature head: a row the head drafts also verifies, in the
            same tree, the first ``branch_nodes`` nodes of the text tree it offered (the one the
            rule above gave to the head: a weak match), as a second branch beside the head's
            chain (merged where they agree), so a row gets the text's drafts where they hold and
            the head's where they do not, in one round. 0: the head's chain alone (the rule
            before). Greedy only: under sampling the existing tree sampler draws all of a node's
            children from one q, and a sampled head chain beside deterministic text siblings is
            not exact under it, so sampled rounds keep the head's chain alone.
        price_width: greedy, beside a feature head, once rounds are timed: each round's trees
            are cut to the width that pays (:meth:`priced`: the text tree of a text row, the
            second branch of a head row, and which rows are text, by expected accepted tokens
            + 1 per second of the round, its verification priced at its width as timed); and
            each round's time is kept at the width it verified. False: the rule before (every
            round counted as one verification whatever its width, trees whole).
        **ngram: :class:`NGram`'s settings (trees only).

    Example:
        >>> cache = SuffixCache(budget=1_000_000)
        >>> out = spec_ext.generate(target, None, ids, policy=Suffix(cache))   # doctest: +SKIP
        >>> out.stats.cache_matched                                             # doctest: +SKIP
    """

    EXPLORE_EVERY = EXPLORE_EVERY

    def __init__(self, cache: SuffixCache | None = None, alpha: float = 1.0, min_prob: float = 0.1,
                 min_score: float | None = None, own_text: bool | None = None, model_memory: float = 0.8,
                 draft_cost: float | None = None, max_depth: int | None = None, branch_nodes: int = 10,
                 price_width: bool = True, cache_nodes: int = 64, **ngram):
        super().__init__(**ngram)
        if not self.tree:
            raise ValueError("tree: Suffix drafts trees (tree=True)")
        if cache is not None and not isinstance(cache, SuffixCache):
            raise ValueError(f"cache: expected a SuffixCache, got {type(cache).__name__}")
        if not alpha > 0 or not 0 <= min_prob <= 1:
            raise ValueError(f"alpha, min_prob: need alpha > 0 and 0 <= min_prob <= 1, got {alpha}, {min_prob}")
        if not 0 <= model_memory < 1:
            raise ValueError(f"model_memory: need 0 <= model_memory < 1, got {model_memory}")
        if max_depth is not None and (not isinstance(max_depth, int) or max_depth < 1):
            raise ValueError(f"max_depth: need an int >= 1 or None, got {max_depth!r}")
        self.max_depth = max_depth
        if not isinstance(cache_nodes, int) or isinstance(cache_nodes, bool) or cache_nodes < 2:
            raise ValueError(f"cache_nodes: need an int >= 2, got {cache_nodes!r}")
        self.solo_cache_nodes = cache_nodes
        self.max_draft = max(self.max_draft, cache_nodes - 1)
        if not isinstance(branch_nodes, int) or isinstance(branch_nodes, bool) or branch_nodes < 0:
            raise ValueError(f"branch_nodes: need an int >= 0, got {branch_nodes!r}")
        self.branch_nodes = branch_nodes
        self.price_width = bool(price_width)
        if draft_cost is not None and not draft_cost >= 0:
            raise ValueError(f"draft_cost: need a number >= 0 (a draft forward's cost in verifications), got "
                             f"{draft_cost}")
        self.cache = SuffixCache() if cache is None else cache
        self.alpha, self.min_prob, self.min_score, self.own_text = alpha, min_prob, min_score, own_text
        self.model_memory = model_memory
        self._draft_cost, self.draft_cost = draft_cost, draft_cost or 0.0
        self.beside_model = False
        # beside a head: the model's chain length, chosen and timed as the default policy does
        # (and, in a round where the cache has nothing to add, per row the own text's chain or the head's)
        self.model_chain = Auto(max_draft=max(self.draft_k, 12), text=own_text is not False and min_score is None)

    def bind(self, target, draft) -> None:
        super().bind(target, draft)
        self.beside_model = draft is not None
        self.draft_cost = (self._draft_cost if self._draft_cost is not None
                           else 0.0 if draft is None else modeled_draft_cost(target, draft))
        if draft is not None:
            self.model_chain.bind(target, draft)

    def start(self, batch_size: int, greedy: bool = True) -> None:
        super().start(batch_size, greedy)
        self.model_chain.start(batch_size, greedy)
        self._chain_k = self.draft_k
        self._model_mean = [BESIDE_MIN_SCORE] * batch_size  # the model's accepted drafts per round, per row
        self._own = [_prior(("own", 0)) for _ in range(batch_size)]  # per row: its own text's (accepted, score)
        self._chosen: list[tuple | None] = [None] * batch_size  # this round: (kind, score) of a row's text tree
        self._offers: list[tuple[bool, int, float] | None] = [None] * batch_size  # this round's offers (text_rows)
        self._planned = None  # price_width: this round's head chain length, chosen at the round's start
        self._chain_nodes: list[list[int] | None] = [None] * batch_size  # this round: a head row's chain's node ids
        self._branch: list[tuple | None] = [None] * batch_size  # this round: a head row's branch (kind, score, nodes)
        self._sums: list[list[float]] = [[0.0]] * batch_size  # priced: per row, the best m nodes' probabilities' sum
        self._path = None  # this round's accepted paths (see_tree_path)
        self._priced_rounds = 0  # rounds priced this call (every EXPLORE_EVERY-th verifies the widest)
        self._as_auto = False  # this round is the default's (as_auto)

    @property
    def measured(self) -> bool:
        """Whether rows choose text or model by the measured rule this call (see the class)."""
        return self.beside_model and self.min_score is None

    @property
    def text_min_score(self) -> float:
        """The least score of a row's text tree this call (see ``min_score``)."""
        return 0.0 if self.min_score is None else self.min_score

    @property
    def uses_own_text(self) -> bool:
        """Whether rows draft from their own text this call (see ``own_text``)."""
        if self.own_text is not None:
            return bool(self.own_text)
        return not self.beside_model or self.min_score is None

    def model_mean(self, row: int) -> float:
        """The model's accepted drafts per round on ``row`` (its running mean)."""
        return self._model_mean[row]

    def cache_nodes(self) -> int:
        """The most nodes (root included) of a row's cache tree this round: the ``cache_nodes``
        given while one row is going, else the own text's budget (:meth:`NGram.tree_budget`);
        never fewer than that budget."""
        nodes = self.tree_budget()[1]
        return max(nodes, self.solo_cache_nodes) if len(self._depth) == 1 else nodes

    def cache_depth(self, depth: int, nodes: int) -> int:
        """The deepest a row's cache tree of at most ``nodes`` nodes may go this round (its own
        text's: ``depth``, NGram's ``k``): ``max_depth`` (None: ``nodes - 1``; the paper's rule,
        at most ``alpha`` x the match length nodes, sizes it), never shallower than ``depth``."""
        most = nodes - 1 if self.max_depth is None else min(self.max_depth, nodes - 1)
        return max(depth, most)

    def text_rows(self, offers: Sequence[tuple[bool, int, float] | None]) -> list[bool]:
        """Which rows draft their text tree this round, from each row's offer (from the cache or
        not, match length n, score; None: no tree): alone or with a fixed ``min_score``, those
        scoring at least it; the measured rule (beside a model) see :meth:`measured_choice`.
        Recorded for :meth:`observe`."""
        self._chosen = [None] * len(offers)
        self._offers = list(offers)
        if not self.measured:
            return [offer is not None and offer[2] >= self.text_min_score for offer in offers]
        expected = [None if offer is None else self.expected(r, *offer) for r, offer in enumerate(offers)]
        chosen = self.measured_choice(expected)
        for r, (text, offer) in enumerate(zip(chosen, offers)):
            if text:
                self._chosen[r] = (match_kind(offer[0], offer[1]), offer[2])
        return chosen

    def expected(self, row: int, from_cache: bool, n: int, score: float) -> float:
        """The drafts a row's text tree is expected to get accepted: its score times the accepted
        share of the score measured for its kind of match (the cache's, across calls:
        :meth:`SuffixCache.expected`; the row's own text's, this call)."""
        if from_cache:
            return self.cache.expected(match_kind(True, n), score)
        accepted, scored = self._own[row]
        return score * accepted / scored

    def measured_choice(self, expected: Sequence[float | None]) -> list[bool]:
        """Per row, text (True) or the model, from its text tree's expected accepted drafts (None:
        no tree) and the model's running mean: the better of (a) each row the larger of the two,
        the model run for its rows, and (b) every row with a tree drafting it, the model not run
        (each row's 1 + drafts over a round's cost: 1 without the model, 1 + ``draft_k`` x
        :attr:`draft_cost` with it). At batch 1: the text where 1 + expected >= (1 + the model's
        mean) / (1 + draft_k x draft_cost)."""
        means = self._model_mean
        by_row = [e is not None and e > m for e, m in zip(expected, means)]
        if all(by_row):
            return by_row
        with_model = sum(1 + (e if text else m) for e, m, text in zip(expected, means, by_row))
        without = sum(1 + (e or 0.0) for e in expected)
        if any(e is not None for e in expected) and without >= with_model / (1 + self.model_round_cost()):
            return [e is not None for e in expected]
        return by_row

    @property
    def offers(self) -> list[tuple[bool, int, float] | None]:
        """This round's offers, as :meth:`text_rows` got them (from the cache, match length, score)."""
        return self._offers

    @property
    def pricing(self) -> bool:
        """Whether :meth:`priced` decides this round (greedy beside a model, measured rule,
        ``price_width``, the round's costs timed)."""
        chain = self.model_chain
        return (self.measured and self.price_width and chain.timed and chain.draft_cost() is not None
                and chain.verify_cost(1) is not None)

    def priced(self, probs: Sequence[Sequence[float]], depths: Sequence[Sequence[int]] | None = None
               ) -> tuple[list[int], list[int]] | None:
        """Beside a feature head, greedy, once the round's costs are timed (:attr:`pricing`):
        per row, the nodes of its offered text tree it verifies as its round (0: the head's
        row), and for a head row the nodes of that tree it verifies beside the head's chain (the
        second branch, at most ``branch_nodes``); None where the rule of :meth:`text_rows`
        stands (untimed: sampling, a fixed ``min_score``, ``price_width=False``, the first round).

        ``probs``: per row its offered tree's nodes' probabilities (node 1 on; [] for none);
        ``depths``: their depths (None: all 1). Expected accepted drafts (a tree's accepted
        drafts are its nodes on the target's path, so each node counts its chance to lie there):
        a text row's tree cut to its best m nodes (:func:`best_nodes`), its kind's accepted share
        (:meth:`expected`) x their probabilities' sum; a head row, the head's chain of this
        round's length k (:meth:`begin_round`), the sum of :attr:`model_chain`'s survivals to
        depths 1..k (scaled by the row's running mean over the rows' average, so rows where the
        head does better count more), plus for a branch of the tree's best s nodes each node's
        chance x the chance that the chain does not hold it already (1 - the head's survival to
        the node's depth; 1 past the chain).

        The round verifies one width for the batch: every row fills the widest W considered
        (text rows their best W - 1 nodes, head rows the chain and W - 1 - k branch nodes). Over
        W, and over (a) the head drafting for the rows where it is expected to bring more (k
        forwards) and (b) every row its text (no head forward: it waits, :meth:`HeadDrafter.skip`,
        and catches up in its next round; where every row has a tree), the choice maximises the expected tokens (accepted + 1) per second of
        the round: the timed verification at the round's width (:attr:`model_chain`'s rounds,
        kept at the width they verified (:meth:`verifies`), read by :func:`width_costs`) + the
        head's forwards x a forward's timed seconds (or ``draft_cost`` x a 1-token verification,
        where given). Where every width costs the same, trees stay whole. Every
        ``EXPLORE_EVERY``-th priced round chooses at the widest W alone, so that wide
        verifications stay measured (a width judged dear from a line through noisy narrow ones
        would otherwise never be timed again)."""
        if not self.pricing or len(probs) != len(self._offers):
            return None
        self._priced_rounds += 1
        explores = self._priced_rounds % self.EXPLORE_EVERY == 0
        chain = self.model_chain
        k, nodes = self._chain_k, self.tree_budget()[1]
        widest = max(self.cache_nodes(), k + 1)
        verify = width_costs(chain.timed_widths(), widest).__getitem__  # seconds by width, fixed for the round
        forward = chain.draft_cost() if self._draft_cost is None else self._draft_cost * verify(1)
        survival = chain.survival()[:k]  # the head's chain holds the target's path to depth d: survival[d - 1]
        average = sum(self._model_mean) / len(self._model_mean)
        heads = [sum(survival) * (mean / average if average > 0 else 1.0) for mean in self._model_mean]
        curves, branches, sums = [], [], []  # per row, by m: expected accepted of its best m nodes (as its round,
        for r, (offer, p) in enumerate(zip(self._offers, probs)):  # as a branch); their probabilities' sum
            depth = [1] * len(p) if depths is None else depths[r]
            ranked = sorted(range(len(p)), key=lambda i: (-p[i], i)) if offer is not None else []
            share = self.expected(r, offer[0], offer[1], 1.0) if ranked else 0.0
            total, curve, branch = [0.0], [0.0], [0.0]
            for i in ranked:
                total.append(total[-1] + p[i])
                curve.append(curve[-1] + share * p[i])
                held = survival[depth[i] - 1] if depth[i] <= len(survival) else 0.0
                branch.append(branch[-1] + share * p[i] * (1.0 - held))
            sums.append(total)
            curves.append(curve)
            branches.append(branch)
        side_most = max(0, min(self.branch_nodes, nodes - 1 - k))
        every = all(len(c) > 1 for c in curves)
        best = None
        for W in range(widest if explores else 1, widest + 1):  # the widest the round may verify
            if W > k:  # (a) the head drafts for the rows it is expected to bring more
                keep, side, tokens = [], [], 0.0
                for c, b, mean in zip(curves, branches, heads):
                    m, s = min(len(c) - 1, W - 1), min(len(c) - 1, W - 1 - k, side_most)
                    text, head = 1 + c[m], 1 + mean + b[s]
                    keep.append(m if m > 0 and text > head else 0)
                    side.append(0 if keep[-1] else s)
                    tokens += text if keep[-1] else head
                runs = not all(keep)
                width = 1 + max(keep + [k + s for s, m in zip(side, keep) if not m])
                seconds = verify(width) + (chain.draft_forwards(k) if runs else 0) * forward  # (no row: it waits)
                if best is None or tokens / max(seconds, 1e-12) >= best[0]:
                    best = tokens / max(seconds, 1e-12), keep, side
            if every and W > 1:  # (b) every row its text tree, the head not run (it catches up in its next round)
                keep = [min(len(c) - 1, W - 1) for c in curves]
                seconds = verify(1 + max(keep))
                value = sum(1 + c[m] for c, m in zip(curves, keep)) / max(seconds, 1e-12)
                if best is None or value >= best[0]:
                    best = value, keep, [0] * len(keep)
        _, keep, side = best
        self._chosen = [(match_kind(offer[0], offer[1]), total[m]) if m else None
                        for offer, total, m in zip(self._offers, sums, keep)]
        self._sums = sums
        return keep, side

    def cache_may_add(self, lengths: Sequence[int], nodes: int) -> bool:
        """(Beside a feature head, before the round's trees.) Whether :meth:`cache_adds` may say
        yes, from each row's cache match length alone: its tree has at most ``min(nodes - 1,
        alpha x length)`` nodes, each of probability at most 1. False: the round is the default's
        without growing any tree."""
        head = CACHE_OVER_HEAD * self.model_chain.chain_expected
        return any(n > 0 and self.cache.expected(match_kind(True, n), min(nodes - 1, int(self.alpha * n))) > head
                   for n in lengths)

    def cache_adds(self) -> bool:
        """(Beside a feature head, after :meth:`text_rows`.) Whether this round drafts as suffix
        decoding does: some row's offer is the cache's tree and is expected (:meth:`expected`) to
        get more than ``CACHE_OVER_HEAD`` x the drafts the head's chain of its last length is
        expected to get accepted (:attr:`model_chain`'s survivals). Else the round is the
        default's (:meth:`as_auto`)."""
        head = self.model_chain.chain_expected
        return any(offer is not None and offer[0] and self.expected(r, *offer) > CACHE_OVER_HEAD * head
                   for r, offer in enumerate(self._offers))

    def as_auto(self) -> None:
        """This round is the default's: :attr:`model_chain` (an :class:`Auto`) chooses per row
        between the row's own text chain and the head's chain, as ``generate`` with the head and
        no cache does (the drafter runs it), so that where the cache has nothing to add the
        policy drafts as the head alone does. :meth:`observe` hands the round to it."""
        self._as_auto = True
        self._chosen = [None] * len(self._chosen)
        self._planned = None
        self.proposed([0] * len(self._chosen))  # the head drafts for every row (text rows replace theirs)

    def begin_round(self) -> None:
        """(A drafter beside a feature head, at the start of its round, with ``price_width``.)
        The head's chain length for this round, chosen now (:attr:`model_chain`'s plan, which
        also clocks the round that just ended): the round's clock then starts before the head's
        catch-up forward, whose seconds the drafter reports as the head's (started after it, a
        round's time held the next round's catch-up and lost its own: a call's first catch-up,
        over the whole prompt, made it negative and pinned the width's cost at 0); and
        :meth:`priced` prices the chain this round drafts."""
        if self.beside_model and self.price_width:
            self._planned = self._chain_k = self.model_chain.plan()[0]

    def verifies(self, width: int, chain_nodes: Sequence[list[int] | None] | None = None,
                 branch_nodes: Sequence[int] | None = None) -> None:
        """The drafter's report: this round verifies ``width`` tokens per row (the root
        included), so that :attr:`model_chain` keeps the round's time at the width verified (its
        own plan's is the head's chain alone; a text tree or a branch beside the chain is wider);
        ``chain_nodes``: per head row, the node ids of the head's chain in the verified tree
        (None for a text row), so that the head's running mean and its acceptance by depth count
        what its chain got (:meth:`see_tree_path`), not a branch beside it; ``branch_nodes``: per
        row, the best nodes of its offered tree verified beside the chain as :meth:`priced` chose
        them (node ids 1..s), whose accepted share calibrates their kind of match as a text
        round's does. With ``price_width`` False: none is kept (the rule before)."""
        if self.beside_model and self.price_width:
            self.model_chain.verifies(width)
            if chain_nodes is not None:
                self._chain_nodes = list(chain_nodes)
            if branch_nodes is not None:
                self._branch = [(match_kind(offer[0], offer[1]), total[s], s) if s and offer is not None
                                and s < len(total) else None
                                for offer, total, s in zip(self._offers, self._sums, branch_nodes)]

    @property
    def uses_tree_paths(self) -> bool:
        """Whether the engine hands over each round's accepted paths (:meth:`see_tree_path`):
        beside a model with ``price_width``."""
        return self.beside_model and self.price_width

    def see_tree_path(self, path) -> None:
        self._path = path

    def _chain_accepted(self, num_draft, num_accepted) -> tuple[list[int], list[int], list[tuple | None]]:
        """Per row, the head's chain's drafts, those of them accepted (the path's leading nodes
        on the chain; where unknown, the round's), and its text branch's (kind, score, accepted
        nodes: the path's leading nodes among the branch's; None where it had none)."""
        path, self._path = self._path, None
        chains, branches = self._chain_nodes, self._branch
        self._chain_nodes, self._branch = [None] * len(chains), [None] * len(branches)
        drafted, accepted = [int(n) for n in num_draft], [int(a) for a in num_accepted]
        branched: list[tuple | None] = [None] * len(drafted)
        if path is None or not any(c is not None for c in chains):
            return drafted, accepted, branched
        for r, (nodes, branch, row) in enumerate(zip(chains, branches, path.tolist())):
            if nodes is None:
                continue
            accepted_path = row[1:accepted[r] + 1]
            drafted[r], accepted[r] = min(len(nodes), drafted[r]), min(_leading(accepted_path, nodes), drafted[r])
            if branch is not None:
                branched[r] = branch[0], branch[1], _leading(accepted_path, range(1, branch[2] + 1))
        return drafted, accepted, branched

    def model_round_cost(self) -> float:
        """What the model's drafts add to a round, in verifications: its chain's forwards
        (:meth:`plan`'s length) x one forward's cost, measured by :attr:`model_chain` (greedy:
        the timed draft forward over the timed verification of the chain) where both are known,
        else ``draft_cost`` (given, or :func:`modeled_draft_cost`)."""
        k = self._chain_k
        if self._draft_cost is None and self.model_chain.timed:
            seconds, verify = self.model_chain.draft_cost(), self.model_chain.verify_cost(k + 1)
            if seconds is not None and verify:
                return self.model_chain.draft_forwards(k) * seconds / verify
        return k * self.draft_cost

    def drafted(self, seconds: float, forwards: int, averaged: bool = True) -> None:
        """The drafter's report: this round's model forwards took ``seconds``. With
        ``price_width``, those of a round where ``averaged`` is False (the head's first forward,
        which reads the whole prompt) are taken out of the round's time but not averaged into a
        forward's cost."""
        self.model_chain.drafted(seconds, forwards, averaged=averaged or not self.price_width)

    def observe(self, num_draft, num_accepted) -> None:
        """The measured rule's counts: a text row's accepted drafts calibrate its kind of match
        (in the cache), a model row's go into the row's running mean. A round of the default's
        (:meth:`as_auto`) is :attr:`model_chain`'s to count, and its head rows' into their means."""
        if self._as_auto:
            self._as_auto = False
            memory, text_rows = self.model_memory, self.model_chain.text_rows
            for r, (drafted, accepted) in enumerate(zip(num_draft, num_accepted)):
                if drafted > 0 and not text_rows[r]:
                    self._model_mean[r] = memory * self._model_mean[r] + (1 - memory) * int(accepted)
            self.model_chain.observe(num_draft, num_accepted)
            return
        chain_draft, chain_accepted, branched = (self._chain_accepted(num_draft, num_accepted) if self.uses_tree_paths
                                                 else (num_draft, num_accepted, [None] * len(num_draft)))
        if self.measured:
            memory = self.model_memory
            for r, (drafted, accepted, own) in enumerate(zip(num_draft, num_accepted, chain_accepted)):
                chosen = self._chosen[r]
                if chosen is None and branched[r] is not None:  # a head row's text branch: its share too
                    chosen, accepted = branched[r][:2], branched[r][2]
                if chosen is not None and chosen[0][0] == "cache":
                    self.cache.calibrate(chosen[0], int(accepted), chosen[1])
                elif chosen is not None:
                    before_accepted, before_scored = self._own[r]
                    self._own[r] = (OWN_DECAY * before_accepted + min(int(accepted), chosen[1]),
                                    OWN_DECAY * before_scored + chosen[1])
                if self._chosen[r] is None and drafted > 0:
                    self._model_mean[r] = memory * self._model_mean[r] + (1 - memory) * int(own)
        if self.beside_model:  # the chain's acceptance: the model's rows alone
            model_rows = [0 if chosen is not None else int(n) for chosen, n in zip(self._chosen, chain_draft)]
            self.model_chain.observe(model_rows, chain_accepted)
        self._chosen = [None] * len(self._chosen)
        super().observe(num_draft, num_accepted)

    def keep_rows(self, rows) -> None:
        super().keep_rows(rows)
        self._model_mean = [self._model_mean[r] for r in rows]
        self._own = [self._own[r] for r in rows]
        self._chosen = [self._chosen[r] for r in rows]
        self._offers = [self._offers[r] for r in rows]
        self._chain_nodes = [self._chain_nodes[r] for r in rows]
        self._branch = [self._branch[r] for r in rows]
        self._sums = [self._sums[r] for r in rows]
        if self.beside_model:
            self.model_chain.keep_rows(rows)

    def remember(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """Add a call's finished rows (prompt, new tokens) to the cache."""
        for prompt, output in zip(prompts, outputs):
            self.cache.add(prompt, output)

    def plan(self) -> list[int]:
        """Beside a feature head: its drafts for each row, the length
        :class:`~spec_ext.policies.Auto` chooses from the chain's measured acceptance and
        costs (:attr:`model_chain`, clocked every round), none in a round where every row
        drafts its text (set through :meth:`proposed`)."""
        if self._planned is None:
            self._chain_k = self.model_chain.plan()[0]
        self._planned = None
        k = 0 if all(self._proposed) else self._chain_k
        return [k] * len(self._proposed)
