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
mean per row; :meth:`Suffix.measured_choice`).

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

    def propose(self, match: SuffixMatch, depth: int, nodes: int, alpha: float = 1.0,
                min_prob: float = 0.1) -> tuple[list[int], list[int], int, float]:
        """The row's draft tree: (tokens, parents, match length, score).

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
                return [-1], [-1], 0, 0.0
            start = [(a, a.state_of(s, n)) for a, s, length in places if length >= n]
            tokens, parents, score = _best_first(start, depth,
                                                 min(nodes - 1, int(alpha * n)), min_prob)
            return tokens, parents, n, score


def _best_first(start, depth: int, most: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """Grow the tree from the places ``start`` [(automaton, state)] of the match, best first:
    (tokens, parents, score). Ties go to the earlier parent, then the smaller token."""
    tokens, parents, score = [-1], [-1], 0.0
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
        score -= p
        if level < depth:
            push(child, -p, node, level + 1)
    return tokens, parents, score


# beside a draft model or a head: the model's accepted drafts per round assumed before a row
# measured its own (the bundled head's rounds accept about this many on the bundled pair)
BESIDE_MIN_SCORE = 2.0
# the accepted share of a text tree's score before any round of its kind measured it, by
# (source, match length bucket): short matches seen once score their size yet rarely hold
PRIOR_SHARE = {("own", 0): 0.5, ("cache", 1): 0.25, ("cache", 4): 0.4, ("cache", 8): 0.6, ("cache", 16): 0.8,
               ("cache", 32): 0.9}
PRIOR_WEIGHT = 8.0  # the prior counts as this much score
CALIBRATION_DECAY = 0.97  # the cache's, per round of the kind: the share follows the workload
OWN_DECAY = 0.8  # a row's own text's, per round it drafted it (a row repeats itself or not: it shows soon)


def match_kind(from_cache: bool, n: int) -> tuple[str, int]:
    """The kind a text tree's calibration is kept by: its source and its match length (the
    own text's n-gram length; the cache's by powers of two: 1-3, 4-7, 8-15, 16-31, 32+)."""
    if not from_cache:
        return "own", max(1, min(n, 2))
    return "cache", next(b for b in (32, 16, 8, 4, 1) if n >= b)


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


def _prior(kind: tuple[str, int]) -> tuple[float, float]:
    return PRIOR_SHARE.get(kind, 0.3) * PRIOR_WEIGHT, PRIOR_WEIGHT


@register
class Suffix(NGram):
    """Suffix decoding: :class:`NGram` (the row's own text, today's matcher) plus a
    :class:`SuffixCache` of earlier requests; each round a row drafts the cache's tree where
    the cache's match is longer than its own text's (the own text's tree otherwise), grown by
    the paper's rule (:meth:`SuffixCache.propose`: best first by empirical probability, at most
    ``alpha`` x match length nodes, none below ``min_prob``) within :meth:`NGram.tree_budget`.
    Drafts are deterministic (one-hot q): exact at every temperature. ``generate`` adds each
    finished row to the cache after the call.

    Beside a draft model or a head (``min_score`` None), a row drafts its text tree only where
    the tree is expected to get more drafts accepted than the model's chain: the tree's score
    times the accepted share of the score measured so far for its kind of match
    (:meth:`SuffixCache.expected`, kept in the cache across calls: a short match seen once
    scores its size, yet is rarely accepted whole) against the model's accepted drafts per
    round, a running mean per row (``BESIDE_MIN_SCORE`` before the row measured one).

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
        max_depth: the deepest a cache tree goes (None: as deep as the round's node budget,
            ``NGram.tree_budget``; the paper's rule sizes it: a 64-token match of a request seen
            before drafts a chain of 31 at batch 1). The own text's trees keep NGram's ``k``.
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
        **ngram: :class:`NGram`'s settings (trees only).

    Example:
        >>> cache = SuffixCache(budget=1_000_000)
        >>> out = spec_ext.generate(target, None, ids, policy=Suffix(cache))   # doctest: +SKIP
        >>> out.stats.cache_matched                                             # doctest: +SKIP
    """

    def __init__(self, cache: SuffixCache | None = None, alpha: float = 1.0, min_prob: float = 0.1,
                 min_score: float | None = None, own_text: bool | None = None, model_memory: float = 0.8,
                 draft_cost: float | None = None, max_depth: int | None = None, branch_nodes: int = 10, **ngram):
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
        if not isinstance(branch_nodes, int) or isinstance(branch_nodes, bool) or branch_nodes < 0:
            raise ValueError(f"branch_nodes: need an int >= 0, got {branch_nodes!r}")
        self.branch_nodes = branch_nodes
        if draft_cost is not None and not draft_cost >= 0:
            raise ValueError(f"draft_cost: need a number >= 0 (a draft forward's cost in verifications), got "
                             f"{draft_cost}")
        self.cache = SuffixCache() if cache is None else cache
        self.alpha, self.min_prob, self.min_score, self.own_text = alpha, min_prob, min_score, own_text
        self.model_memory = model_memory
        self._draft_cost, self.draft_cost = draft_cost, draft_cost or 0.0
        self.beside_model = False
        # beside a head: the model's chain length, chosen and timed as the default policy does
        self.model_chain = Auto(max_draft=max(self.draft_k, 12), text=False)

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

    def cache_depth(self, depth: int, nodes: int) -> int:
        """The deepest a row's cache tree may go this round (its own text's: ``depth``, NGram's
        ``k``): ``max_depth`` (None: the tree's node budget; the paper's rule, at most ``alpha``
        x the match length nodes, sizes it), never shallower than ``depth``."""
        most = nodes - 1 if self.max_depth is None else min(self.max_depth, nodes - 1)
        return max(depth, most)

    def text_rows(self, offers: Sequence[tuple[bool, int, float] | None]) -> list[bool]:
        """Which rows draft their text tree this round, from each row's offer (from the cache or
        not, match length n, score; None: no tree): alone or with a fixed ``min_score``, those
        scoring at least it; the measured rule (beside a model) see :meth:`measured_choice`.
        Recorded for :meth:`observe`."""
        self._chosen = [None] * len(offers)
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

    def model_round_cost(self) -> float:
        """What the model's drafts add to a round, in verifications: its chain's forwards
        (:meth:`plan`'s length) x one forward's cost, measured by :attr:`model_chain` (greedy:
        the timed draft forward over the timed verification of the chain) where both are known,
        else ``draft_cost`` (given, or :func:`modeled_draft_cost`)."""
        k = self._chain_k
        if self._draft_cost is None and self.model_chain._timed:
            seconds, verify = self.model_chain.draft_cost(), self.model_chain.verify_cost(k + 1)
            if seconds is not None and verify:
                return self.model_chain.draft_forwards(k) * seconds / verify
        return k * self.draft_cost

    def drafted(self, seconds: float, forwards: int) -> None:
        """The drafter's report: this round's model forwards took ``seconds``."""
        self.model_chain.drafted(seconds, forwards)

    def observe(self, num_draft, num_accepted) -> None:
        """The measured rule's counts: a text row's accepted drafts calibrate its kind of match
        (in the cache), a model row's go into the row's running mean."""
        if self.measured:
            memory = self.model_memory
            for r, (drafted, accepted) in enumerate(zip(num_draft, num_accepted)):
                chosen = self._chosen[r]
                if chosen is not None and chosen[0][0] == "cache":
                    self.cache.calibrate(chosen[0], int(accepted), chosen[1])
                elif chosen is not None:
                    before_accepted, before_scored = self._own[r]
                    self._own[r] = (OWN_DECAY * before_accepted + min(int(accepted), chosen[1]),
                                    OWN_DECAY * before_scored + chosen[1])
                elif drafted > 0:
                    self._model_mean[r] = memory * self._model_mean[r] + (1 - memory) * int(accepted)
        if self.beside_model:  # the chain's acceptance: the model's rows alone
            model_rows = [0 if chosen is not None else int(n) for chosen, n in zip(self._chosen, num_draft)]
            self.model_chain.observe(model_rows, num_accepted)
        self._chosen = [None] * len(self._chosen)
        super().observe(num_draft, num_accepted)

    def keep_rows(self, rows) -> None:
        super().keep_rows(rows)
        self._model_mean = [self._model_mean[r] for r in rows]
        self._own = [self._own[r] for r in rows]
        self._chosen = [self._chosen[r] for r in rows]
        if self.beside_model:
            self.model_chain.keep_rows(rows)

    def remember(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
        """Add a call's finished rows (prompt, new tokens) to the cache."""
        for prompt, output in zip(prompts, outputs):
            self.cache.add(prompt, output)

    def plan(self) -> list[int]:
        """Beside a feature head (which runs every round): its drafts for each row, the length
        :class:`~spec_ext.policies.Auto` chooses from the chain's measured acceptance and
        costs (:attr:`model_chain`, clocked every round), none in a round where every row
        drafts its text (set through :meth:`proposed`)."""
        self._chain_k = self.model_chain.plan()[0]
        k = 0 if all(self._proposed) else self._chain_k
        return [k] * len(self._proposed)
