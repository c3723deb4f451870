"""The text drafter (prompt lookup, n-gram drafting): each row's drafts are the tokens that
followed an earlier occurrence of its current suffix in its own prompt + output; the
:class:`spec_ext.policies.NGram` policy holds the settings and says how deep to go."""
from __future__ import annotations

import torch
from torch import Tensor

from spec_ext import ops
from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler
from spec_ext.policies import NGram, NGramIndex, continuation_tree


class TextDrafter(Drafter):
    """Chains (the most recent occurrence) or trees (the continuations of several
    occurrences merged) copied from each row's text, as ``policy.tree`` says. Drafts are a
    deterministic function of the text (one-hot q), so verification is exact at every
    temperature. A row whose suffix never occurred before drafts nothing.

    Example:
        >>> policy = NGram(tree=False); policy.start(batch_size=1)
        >>> drafter = TextDrafter(policy)
        >>> drafter.start([[1, 2, 3, 1, 2]], capacity=64, sampler=Sampler())
        >>> drafter.chains()
        [[3, 1, 2]]
    """

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        self.rows = [NGramIndex(s, self.policy.n_max, self.policy.n_min) for s in seqs]
        cache = getattr(self.policy, "cache", None)  # a Suffix policy's: each row's place in it
        self.matches = None if cache is None else [cache.match(index.tokens) for index in self.rows]
        self.from_cache = [False] * len(seqs)  # the rows whose trees this round came from the cache
        self.offered: list[tuple[list[int], list[int]]] = [([-1], [-1])] * len(seqs)  # this round's text trees
        # a Suffix policy's round, per row: its own text's (tokens, parents, match length, score, continuations)
        self.own: list[tuple | None] = [None] * len(seqs)

    def chains(self) -> list[list[int]]:
        """Per row, its drafts this round ([] where its suffix never occurred before)."""
        drafts = []
        for index, k in zip(self.rows, self.policy.chain_depths()):
            _, starts = index.occurrences(1)
            drafts.append(index.continuations(starts, k)[0] if starts else [])
        self.policy.proposed([len(d) for d in drafts])
        return drafts

    def trees(self) -> list[tuple[list[int], list[int]]]:
        """Per row, (tokens, parents) of its tree this round (see
        :func:`spec_ext.policies.continuation_tree`; the root alone where its suffix never
        occurred before)."""
        depths, nodes = self.policy.tree_budget()
        if self.matches is not None:
            return self._suffix_trees(depths, nodes)
        trees = []
        for index, depth in zip(self.rows, depths):
            _, starts = index.occurrences(self.policy.max_continuations)
            trees.append(continuation_tree(index.continuations(starts, depth), nodes))
        return trees

    def _suffix_trees(self, depths: list[int], nodes: int) -> list[tuple[list[int], list[int]]]:
        """A Suffix policy's trees: the cache's where its match is longer than the row's own
        text's (when the policy's ``uses_own_text``), else the own text's; the root alone where
        the policy's ``text_rows`` says no (beside a model, those rows are the model's)."""
        policy, trees, offers = self.policy, [], []
        own, cache_nodes = policy.uses_own_text, policy.cache_nodes()
        for r, (index, match, depth) in enumerate(zip(self.rows, self.matches, depths)):
            n, tokens, parents, score = 0, [-1], [-1], 0.0
            if own:
                n, starts = index.occurrences(policy.max_continuations)
                continued = index.continuations(starts, depth)
                tokens, parents, score = continuation_tree(continued, nodes, scored=True)
                self.own[r] = tokens, parents, n, score, continued
            cached = policy.cache.propose(match, policy.cache_depth(depth, cache_nodes), cache_nodes, policy.alpha,
                                          policy.min_prob)
            self.from_cache[r] = cached[2] > n and len(cached[0]) > 1
            if self.from_cache[r]:
                tokens, parents, n, score = cached
            trees.append((tokens, parents))
            offers.append((self.from_cache[r], n, score) if len(tokens) > 1 else None)
        self.offered = trees  # before the rule: a head row may still verify its text beside the head's chain
        self._offers = offers
        return self.ruled()

    def ruled(self) -> list[tuple[list[int], list[int]]]:
        """(A Suffix policy's round, after :meth:`trees`.) The offered trees under the policy's
        ``text_rows`` rule, decided now (again: after the head's chain length for the round was
        chosen); the root alone for the rows the rule gives to the model."""
        trees = list(self.offered)
        self.from_cache = [offer is not None and offer[0] for offer in self._offers]
        for r, text in enumerate(self.policy.text_rows(self._offers)):
            if not text:
                self.from_cache[r] = False
                trees[r] = ([-1], [-1])
        return trees

    def propose(self, seqs: list[list[int]], roots: Tensor) -> Proposal:
        device = roots.device
        if not self.policy.tree:
            chains = self.chains()
            return chain_proposal(chains, max(map(len, chains)), device)
        trees = self.trees()
        proposal, depths = tree_proposal(trees, device)
        proposal.from_cache = list(self.from_cache)
        self.policy.proposed(depths)
        return proposal

    def commit(self, outcome: Outcome) -> None:
        for index, tokens in zip(self.rows, outcome.committed):
            index.extend(tokens)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.rows = [self.rows[r] for r in rows]
        self.from_cache = [self.from_cache[r] for r in rows]
        self.offered = [self.offered[r] for r in rows]
        self.own = [self.own[r] for r in rows]
        if self.matches is not None:
            self.matches = [self.matches[r] for r in rows]


def chain_proposal(chains: list[list[int]], width: int, device) -> Proposal:
    """Deterministic chains (host lists, at most ``width`` tokens) as a :class:`Proposal`."""
    tokens = torch.tensor([c + [-1] * (width - len(c)) for c in chains], dtype=torch.int64).view(len(chains), width)
    return Proposal(tokens.to(device), torch.tensor([len(c) for c in chains]).to(device),
                    from_text=[bool(c) for c in chains])


def tree_proposal(trees: list[tuple[list[int], list[int]]], device, width: int = 0,
                  from_text: list[bool] | None = None) -> tuple[Proposal, list[int]]:
    """Per-row trees (host (tokens, parents) lists, node 0 the root) padded to one width
    (at least ``width``) with absent nodes, as a deterministic tree :class:`Proposal`, and
    each row's depth (host). ``from_text``: the rows copied from the text (default: those
    with a node past the root)."""
    T = max(width, max(len(tokens) for tokens, _ in trees))
    host = torch.tensor([t + [-1] * (T - len(t)) + p + [0] * (T - len(p)) for t, p in trees], dtype=torch.int64)
    depth, _ = ops.tree_mask(host[:, T:], validate=False)  # the depths are read on the host
    depths = depth.masked_fill(host[:, :T] < 0, 0).max(1).values.tolist()
    tokens, parents = host.to(device).split(T, 1)  # one copy to the device
    depth, mask = ops.tree_mask(parents, validate=False)
    from_text = [len(t) > 1 for t, _ in trees] if from_text is None else from_text
    proposal = Proposal(tokens, (tokens[:, 1:] >= 0).sum(1), None, parents, depth, mask, max(depths),
                        from_text=from_text)
    return proposal, depths
