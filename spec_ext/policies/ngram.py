"""Prompt lookup (n-gram drafting): drafts taken from each row's own text, no draft model.

Each round, for every row, the longest suffix of the row's prompt + output, of ``n_max``
down to ``n_min`` tokens, that occurred earlier is looked up; the tokens that followed it
there are the drafts (a chain: the most recent occurrence; a tree: the distinct
continuations of several occurrences merged, siblings distinct tokens). Drafts are a
deterministic function of the text, so the samplers verify them with one-hot q
(``draft_probs=None``): exact at every temperature.

:class:`NGramIndex` is the incremental matcher (an index of every n-gram of a row's history,
extended with each round's committed tokens, never rescanned); :func:`spec_ext.reference.reference_occurrences`
is the plain scan it is tested against. :class:`NGram` holds the settings; its controller each row's
depth; the drafters' :class:`~spec_ext.drafters.text.TextSource` keeps one index per row.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import ClassVar, Sequence

from spec_ext.policies.base import Call, Controller, Offer, Policy, Report, RoundPlan, RoundState, Source, check, \
    node_depths, register, renumbered


class NGramIndex:
    """The n-grams of one row's history (of n_min..n_max tokens) -> where each occurrence
    ended, in order; :meth:`extend` indexes only the new tokens (O(n_max) per token), and
    :meth:`occurrences` answers what :func:`spec_ext.reference.reference_occurrences` does without a scan.

    Example:
        >>> index = NGramIndex([1, 2, 3, 1, 2], n_max=2, n_min=1)
        >>> index.occurrences(4)
        (2, [2])
        >>> index.extend([4, 1, 2]); index.occurrences(4)
        (2, [5, 2])
    """

    def __init__(self, tokens: Sequence[int], n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens and index the n-grams that end at them."""
        history, ends = self.tokens, self._ends
        for token in tokens:
            history.append(int(token))
            end = len(history)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                key = tuple(history[end - n:])
                found = ends.get(key)
                if found is None:
                    ends[key] = [end]
                else:
                    found.append(end)

    def occurrences(self, most: int) -> tuple[int, list[int]]:
        """(n, starts): the longest suffix length with an earlier occurrence and up to
        ``most`` of the positions just after those occurrences, most recent first."""
        history, L = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            found = self._ends.get(tuple(history[L - n:]))
            if found is not None and len(found) > 1:  # the last entry is the suffix itself
                return n, found[-2:-2 - most:-1]
        return 0, []

    def continuations(self, starts: Sequence[int], k: int) -> list[list[int]]:
        """The up to ``k`` tokens that follow each start."""
        return [self.tokens[s:s + k] for s in starts]


def continuation_tree(continuations: Sequence[Sequence[int]], max_nodes: int, shares: bool = False) -> tuple:
    """Merge token sequences into a tree of at most ``max_nodes`` nodes counting the root.

    Returns (tokens, parents): node 0 is the root (token -1 here; the engine puts the last
    committed token there), nodes in topological order, siblings distinct tokens. Nodes are
    kept by how many of the sequences pass through them (then shallower, then earlier
    sequences first), so a node's parent always comes before it and the tree is the most
    shared part of the continuations; siblings come out most shared first. ``shares``: also
    each node's share of the sequences through it (node 1 on), its empirical probability.

    Example:
        >>> continuation_tree([[5, 6, 7], [5, 6, 8], [9]], max_nodes=5)
        ([-1, 5, 9, 6, 7], [-1, 0, 0, 1, 3])
    """
    children: list[dict[int, int]] = [{}]
    token_of, parent_of, count, depth = [-1], [-1], [0], [0]
    for sequence in continuations:
        node = 0
        for token in sequence:
            child = children[node].get(token)
            if child is None:
                child = len(token_of)
                children[node][token] = child
                children.append({})
                token_of.append(token)
                parent_of.append(node)
                count.append(0)
                depth.append(depth[node] + 1)
            count[child] += 1
            node = child
    order = sorted(range(1, len(token_of)), key=lambda i: (-count[i], depth[i], i))[:max_nodes - 1]
    order.sort(key=lambda i: (depth[i], -count[i], i))  # breadth first: each level's nodes together
    tokens, parents = [-1] + [token_of[i] for i in order], renumbered(parent_of, order)
    if not shares:
        return tokens, parents
    return tokens, parents, [count[i] / max(1, len(continuations)) for i in order]


@dataclass(frozen=True)
class TextSettings:
    """What a call's text source (:class:`spec_ext.drafters.text.TextSource`) indexes: each
    row's n-grams of ``n_min``..``n_max`` tokens, trees of up to ``continuations`` latest
    occurrences, and a suffix ``cache`` of earlier requests (None: none), whose trees follow
    the paper's rule (at most ``alpha`` x the match length nodes, none below ``min_prob``)."""
    n_max: int = 2
    n_min: int = 1
    continuations: int = 8
    cache: object = None
    alpha: float = 1.0
    min_prob: float = 0.1


class _Lookup(Controller):
    """Each row drafts its own text (a chain or a tree within NGram's budget); beside a model,
    the rows without a match take the model's ``draft_k`` drafts."""

    per_row = ("depth",)

    def __init__(self, policy: "NGram", call: Call):
        super().__init__(policy, call)
        self.depth = [policy.k] * call.batch_size  # each row's most text drafts in a line next round

    def budget(self, rows: int) -> tuple[int, int]:
        """(the deepest a row's text chain or tree may go, a tree's most nodes counting the root)."""
        policy = self.policy
        if not policy.tree:
            return max(1, min(policy.k, policy.round_tokens // rows - 1)), 0
        nodes = max(2, min(policy.max_nodes, policy.round_tokens // rows))
        return nodes - 1, nodes

    def offers(self, state: RoundState) -> list[Offer | None]:
        most, nodes = self.budget(state.rows)
        if not self.policy.tree:
            return [Offer(Source.TEXT, tuple(chain)) if chain else None
                    for chain in (state.text.chain(r, min(most, d)) for r, d in enumerate(self.depth))]
        return [state.text.tree(r, min(most, d), nodes) for r, d in enumerate(self.depth)]

    def plan(self, state: RoundState) -> RoundPlan:
        text = self.offers(state)
        model = self.policy.draft_k if self.call.draft is not None else 0
        return RoundPlan([0 if t is not None else model for t in text], text, record=[_depth(t) for t in text])

    def observe(self, report: Report) -> None:
        """With ``adapt_depth``: a row whose text drafts were all accepted drafts twice as deep
        next round (up to k), one whose drafts were cut drafts one past what was accepted."""
        if self.policy.adapt_depth:
            for r, (depth, accepted) in enumerate(zip(report.plan.record, report.accepted)):
                if depth:  # a full accept of drafts the budget or the history cut short keeps the depth
                    self.depth[r] = (max(self.depth[r], min(self.policy.k, 2 * depth)) if accepted >= depth
                                     else max(1, accepted + 1))


def _depth(offer: Offer | None) -> int:
    """How deep a text offer goes (0: none)."""
    if offer is None:
        return 0
    if offer.parents is None:
        return len(offer.tokens)
    return max(node_depths(offer.parents))


@register
@dataclass(frozen=True)
class NGram(Policy):
    """Prompt lookup: each row drafts the tokens that followed the longest earlier occurrence
    of its current suffix (``n_max`` down to ``n_min`` tokens) in its own prompt + output.

    Defaults and their sources: ``k=10`` tokens per draft (``prompt_lookup_num_tokens=10``,
    the value of HF's prompt-lookup documentation and of the original prompt-lookup
    decoding code), ``n_max=2``, ``n_min=1`` (HF's ``max_matching_ngram_size`` default 2,
    down to 1 token; vLLM's ngram proposer uses ``prompt_lookup_max = prompt_lookup_min = 5``
    when neither is set, a choice its code calls arbitrary).

    A row whose suffix never occurred before drafts nothing that round (verification still
    emits its one token); with a draft model given (``generate(target, draft, ...,
    policy=NGram())``) such rows are drafted by the draft model instead, ``draft_k`` tokens,
    in the same round and the same target forward.

    Args:
        k: most tokens drafted per row and round (the chain's length, the tree's depth).
        n_max, n_min: the longest and the shortest suffix looked up.
        tree: False: a chain from the most recent occurrence. True (the default): the
            distinct continuations of up to ``max_continuations`` most recent occurrences
            merged into a tree of at most ``max_nodes`` nodes (root included), verified in
            one forward with tree attention (siblings drawn without replacement); measured in
            ``docs/suffix.md``: the tree leads on held-out text, a chain on copies.
        draft_k: drafts per round of the draft model, for rows without a match (only with a
            draft model).
        round_tokens: the most tokens the text's drafts of all rows may add to one
            verification: with B rows going, a row drafts at most ``round_tokens // B - 1``
            tokens (chains, at least 1) or ``round_tokens // B`` nodes (trees, at least 2), so
            the batch-1 shapes (k=10, 32 nodes) shrink as the batch grows and grow back as
            rows finish; a verification's cost on CPU grows with its tokens.
        adapt_depth: a row whose text drafts were all accepted drafts twice as deep next
            round (up to ``k``), one whose drafts were cut drafts one past what was accepted.

    Example:
        >>> out = spec_ext.generate(target, None, ids, policy="ngram")   # doctest: +SKIP
        >>> out.stats.matched, out.stats.row_matched                      # doctest: +SKIP
    """
    needs_model: ClassVar[bool] = False
    _: KW_ONLY
    k: int = 10
    n_max: int = 2
    n_min: int = 1
    tree: bool = True
    max_nodes: int = 32
    max_continuations: int = 8
    draft_k: int = 5
    round_tokens: int = 32
    adapt_depth: bool = False

    def __post_init__(self):
        check(self.k >= 1 and self.draft_k >= 1, "k, draft_k", f"must be >= 1, got {self.k}, {self.draft_k}")
        check(1 <= self.n_min <= self.n_max, "n_min, n_max", f"need 1 <= n_min <= n_max, got {self.n_min}, "
              f"{self.n_max}")
        check(self.round_tokens >= 2, "round_tokens", f"must be >= 2, got {self.round_tokens}")
        check(self.max_nodes >= 2 and self.max_continuations >= 1, "max_nodes, max_continuations",
              f"need >= 2 and >= 1, got {self.max_nodes}, {self.max_continuations}")

    @property
    def max_draft(self) -> int:
        return max(self.max_nodes - 1 if self.tree else self.k, self.draft_k)

    def text_settings(self, has_model: bool) -> TextSettings:
        return TextSettings(self.n_max, self.n_min, self.max_continuations)

    def start(self, call: Call) -> Controller:
        return _Lookup(self, call)
