"""The rows' text as a source of drafts (prompt lookup, n-gram drafting, suffix decoding):
each row's drafts are the tokens that followed earlier occurrences of its current suffix, in
its own prompt and output or, with a :class:`~spec_ext.policies.SuffixCache`, in earlier
requests. :class:`TextSource` keeps the indexes in step with what the target commits and
answers the controllers' lookups (:class:`~spec_ext.policies.TextLookup`); the drafts it
offers are a deterministic function of the text (one-hot q): exact at every temperature."""
from __future__ import annotations

import torch

from spec_ext import ops
from spec_ext.drafters.base import Outcome, Proposal
from spec_ext.policies import NGramIndex, Offer, Source, TextSettings, continuation_tree


class TextSource:
    """Per row an n-gram index of its prompt and output (:class:`~spec_ext.policies.NGramIndex`)
    and, where ``settings.cache`` is set, its place in the suffix cache.

    Example:
        >>> text = TextSource(TextSettings())
        >>> text.start([[1, 2, 3, 1, 2]])
        >>> text.chain(0, 8)
        [3, 1, 2]
    """

    def __init__(self, settings: TextSettings):
        self.settings = settings

    def start(self, seqs: list[list[int]]) -> None:
        s = self.settings
        self.rows = [NGramIndex(seq, s.n_max, s.n_min) for seq in seqs]
        self.matches = None if s.cache is None else [s.cache.match(index.tokens) for index in self.rows]

    def chain(self, row: int, most: int) -> list[int]:
        _, starts = self.rows[row].occurrences(1)
        return self.rows[row].continuations(starts, most)[0] if starts and most > 0 else []

    def tree(self, row: int, depth: int, nodes: int) -> Offer | None:
        index = self.rows[row]
        n, starts = index.occurrences(self.settings.continuations)
        if not starts:
            return None
        tokens, parents, shares = continuation_tree(index.continuations(starts, depth), nodes, shares=True)
        return Offer(Source.TEXT, tuple(tokens), tuple(parents), n, tuple(shares)) if len(tokens) > 1 else None

    def cache_match(self, row: int) -> int:
        return 0 if self.matches is None else self.settings.cache.match_length(self.matches[row])

    def cache_tree(self, row: int, depth: int, nodes: int) -> Offer | None:
        if self.matches is None:
            return None
        s = self.settings
        tree = s.cache.propose(self.matches[row], depth, nodes, s.alpha, s.min_prob)
        if len(tree.tokens) <= 1:
            return None
        return Offer(Source.CACHE, tuple(tree.tokens), tuple(tree.parents), tree.match, tuple(tree.probs))

    def commit(self, outcome: Outcome) -> None:
        for index, tokens in zip(self.rows, outcome.committed):
            index.extend(tokens)

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]
        if self.matches is not None:
            self.matches = [self.matches[r] for r in rows]


def chain_proposal(chains: list[list[int]], width: int, device) -> Proposal:
    """Deterministic chains (host lists, at most ``width`` tokens) as a :class:`Proposal`."""
    tokens = torch.tensor([c + [-1] * (width - len(c)) for c in chains], dtype=torch.int64).view(len(chains), width)
    return Proposal(tokens.to(device), torch.tensor([len(c) for c in chains]).to(device))


def tree_proposal(trees: list[tuple[list[int], list[int]]], device, width: int = 0) -> Proposal:
    """Per-row trees (host (tokens, parents) lists, node 0 the root) padded to one width (at
    least ``width``) with absent nodes, as a deterministic tree :class:`Proposal`."""
    T = max(width, max(len(tokens) for tokens, _ in trees))
    host = torch.tensor([list(t) + [-1] * (T - len(t)) + list(p) + [0] * (T - len(p)) for t, p in trees],
                        dtype=torch.int64)
    depth, _ = ops.tree_mask(host[:, T:], validate=False)  # the depths are read on the host
    max_depth = int(depth.masked_fill(host[:, :T] < 0, 0).max())
    tokens, parents = host.to(device).split(T, 1)  # one copy to the device
    depth, mask = ops.tree_mask(parents, validate=False)
    return Proposal(tokens, (tokens[:, 1:] >= 0).sum(1), None, parents, depth, mask, max_depth)
