"""Prompt lookup (n-gram drafting): drafts taken from each row's own text, no draft model.

Each round, for every row, the longest suffix of the row's prompt + output, of ``n_max``
down to ``n_min`` tokens, that occurred earlier is looked up; the tokens that followed it
there are the drafts (a chain: the most recent occurrence; a tree: the distinct
continuations of several occurrences merged, siblings distinct tokens). Drafts are a
deterministic function of the text, so the samplers verify them with one-hot q
(``draft_probs=None``): exact at every temperature.

:class:`NGramIndex` is the incremental matcher (an index of every n-gram of a row's history,
extended with each round's committed tokens, never rescanned); :func:`reference_occurrences`
is the plain scan it is tested against. :class:`NGram` holds the settings and each row's
depth; the drafter :class:`spec_ext.drafters.TextDrafter` keeps one index per row.
"""
from __future__ import annotations

from typing import Sequence

from spec_ext.policies.base import Policy, register


def reference_occurrences(history: Sequence[int], n_max: int, n_min: int) -> tuple[int, list[int]]:
    """The plain matcher (a scan of the whole history): ``(n, starts)`` where n is the
    longest suffix length in [n_min, n_max] that occurred earlier, and ``starts`` the
    positions just after each earlier occurrence, most recent first; ``(0, [])`` if none.

    Example:
        >>> reference_occurrences([1, 2, 3, 1, 2, 4, 1, 2], 2, 1)
        (2, [5, 2])
    """
    L = len(history)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = list(history[L - n:])
        starts = [p for p in range(L - 1, n - 1, -1) if list(history[p - n:p]) == suffix]
        if starts:
            return n, starts
    return 0, []


class NGramIndex:
    """The n-grams of one row's history (of n_min..n_max tokens) -> where each occurrence
    ended, in order; :meth:`extend` indexes only the new tokens (O(n_max) per token), and
    :meth:`occurrences` answers what :func:`reference_occurrences` does without a scan.

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


def continuation_tree(continuations: Sequence[Sequence[int]], max_nodes: int, scored: bool = False) -> tuple:
    """Merge token sequences into a tree of at most ``max_nodes`` nodes counting the root.
    ``scored``: also return the tree's score, the sum over its nodes of the share of the
    sequences through them (the drafts expected accepted if the sequences are equally likely).

    Returns (tokens, parents): node 0 is the root (token -1 here; the engine puts the last
    committed token there), nodes in topological order, siblings distinct tokens. Nodes are
    kept by how many of the sequences pass through them (then shallower, then earlier
    sequences first), so a node's parent always comes before it and the tree is the most
    shared part of the continuations; siblings come out most shared first.

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
    renumber = {0: 0}
    for new, old in enumerate(order, start=1):
        renumber[old] = new
    tokens, parents = [-1] + [token_of[i] for i in order], [-1] + [renumber[parent_of[i]] for i in order]
    return (tokens, parents, sum(count[i] for i in order) / max(1, len(continuations))) if scored else \
        (tokens, parents)


@register
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
            one forward with tree attention (siblings drawn without replacement). Measured
            (benchmarks/results/e2e_ngram_cpu.csv, greedy, tree vs chain, the target alone =
            1): held-out prompts 2.88x vs 2.44x at batch 1, 1.67x vs 1.55x at batch 8;
            input-grounded ones (a copy, where one occurrence is right and the tree's extra
            nodes only cost) 4.97x vs 5.57x and 1.71x vs 1.84x. The tree leads on the
            geometric mean of the four, and on text that is not a copy.
        draft_k: drafts per round of the draft model, for rows without a match (only with a
            draft model).
        round_tokens: the most tokens the text's drafts of all rows may add to one
            verification: with B rows going, a row drafts at most ``round_tokens // B - 1``
            tokens (chains, at least 1) or ``round_tokens // B`` nodes (trees, at least 2), so
            the batch-1 shapes (k=10, 32 nodes) shrink as the batch grows (k=3, 4 nodes at
            batch 8, the best fixed k of the bundled pair at batch 8) and grow back as rows
            finish; a verification's cost on CPU grows with its tokens.
        adapt_depth: a row whose text drafts were all accepted drafts twice as deep next
            round (up to ``k``), one whose drafts were cut drafts one past what was accepted
            (see :meth:`observe`). It verifies fewer tokens for nearly as many accepted; on the
            bundled pair on CPU its time stayed within run-to-run noise, so it is off by
            default: it pays where a verification's width costs compute.

    Example:
        >>> out = spec_ext.generate(target, None, ids, policy="ngram")   # doctest: +SKIP
        >>> out.stats.matched, out.stats.row_matched                      # doctest: +SKIP
    """

    drafts_from_text = True

    def __init__(self, k: int = 10, n_max: int = 2, n_min: int = 1, tree: bool = True, max_nodes: int = 32,
                 max_continuations: int = 8, draft_k: int = 5, round_tokens: int = 32, adapt_depth: bool = False):
        if k < 1 or draft_k < 1:
            raise ValueError(f"k, draft_k: must be >= 1, got {k}, {draft_k}")
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n_min, n_max: need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        if round_tokens < 2:
            raise ValueError(f"round_tokens: must be >= 2, got {round_tokens}")
        if max_nodes < 2 or max_continuations < 1:
            raise ValueError(f"max_nodes, max_continuations: need >= 2 and >= 1, got {max_nodes}, "
                             f"{max_continuations}")
        self.k, self.n_max, self.n_min, self.tree = k, n_max, n_min, bool(tree)
        self.max_nodes, self.max_continuations, self.draft_k = max_nodes, max_continuations, draft_k
        self.round_tokens = round_tokens
        self.adapt_depth = bool(adapt_depth)
        self.max_draft = max(max_nodes - 1 if tree else k, draft_k)

    def start(self, batch_size: int, greedy: bool = True) -> None:
        super().start(batch_size, greedy)
        self._depth = [self.k] * batch_size  # each row's most text drafts in a line next round
        self._proposed = [0] * batch_size  # the depth of each row's text drafts this round (0: none)

    def chain_depths(self) -> list[int]:
        """Per row, the most tokens its text chain may have this round."""
        k = max(1, min(self.k, self.round_tokens // len(self._depth) - 1))
        return [min(k, depth) for depth in self._depth]

    def tree_budget(self) -> tuple[list[int], int]:
        """(per row the deepest its text tree may go, the most nodes of a tree counting the root)."""
        nodes = max(2, min(self.max_nodes, self.round_tokens // len(self._depth)))
        return [min(depth, nodes - 1) for depth in self._depth], nodes

    def proposed(self, depths: Sequence[int]) -> None:
        """The depth of each row's text drafts this round (0: none), for :meth:`observe`."""
        self._proposed = list(depths)

    def observe(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """With ``adapt_depth``: a row whose text drafts were all accepted drafts twice as deep
        next round (up to k), one whose drafts were cut drafts one past what was accepted."""
        if self.adapt_depth:
            for r, (depth, accepted) in enumerate(zip(self._proposed, num_accepted)):
                if depth:
                    # a full accept of drafts the budget or the history cut short keeps the depth
                    self._depth[r] = (max(self._depth[r], min(self.k, 2 * depth)) if accepted >= depth
                                      else max(1, accepted + 1))

    def keep_rows(self, rows) -> None:
        super().keep_rows(rows)
        self._depth = [self._depth[r] for r in rows]
        self._proposed = [self._proposed[r] for r in rows]
