"""The text's trees beside a feature head (``Suffix`` with a head): one proposal, one target
forward for both kinds of row."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler
from spec_ext.drafters.head import HeadDrafter
from spec_ext.drafters.text import TextDrafter, tree_proposal


class TextBesideHead(Drafter):
    """Each row drafts its text's tree (:class:`TextDrafter` under a
    :class:`~spec_ext.policies.Suffix` policy: the cache's tree, or the row's own text's, where
    the policy's ``text_rows`` expects it to get more accepted than the head, measured: see
    :meth:`~spec_ext.policies.Suffix.measured_choice`); the other rows take the head's chain of
    the length ``policy.plan()`` chooses (:class:`HeadDrafter`; timed here), verified with the q it was drawn from, as a chain
    among the text's trees. The head runs every round: its catch-up feeds it the target's
    features of what was committed, whoever drafted it, so it stays in step; in a round where
    every row drafts its text it only catches up (no draft steps)."""

    def __init__(self, text: TextDrafter, head: HeadDrafter):
        super().__init__(text.policy)
        self.text, self.head = text, head
        self.model = head.model

    @property
    def calls(self) -> int:
        return self.head.calls

    @property
    def proposer(self):
        return self.head.proposer

    @property
    def target_layers(self):
        return self.head.target_layers

    def bind(self, target) -> None:
        self.head.bind(target)

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        self.text.start(seqs, capacity, sampler, generator)
        self.head.start(seqs, capacity, sampler, generator, features=features)

    def propose(self, seqs: list[list[int]], roots: Tensor) -> Proposal:
        device = roots.device
        trees = self.text.trees()
        from_text = [len(tokens) > 1 for tokens, _ in trees]
        self.policy.proposed([int(text) for text in from_text])  # the head's plan: none when all rows have text
        started = time.perf_counter()
        drafted = self.head.propose(seqs, roots)
        k = drafted.tokens.shape[1]
        self.policy.drafted(time.perf_counter() - started, max(k, 1))  # prices the head's chain (Suffix.plan)
        side = min(getattr(self.policy, "branch_nodes", 0), self.policy.tree_budget()[1] - 1 - k)
        if drafted.q is None and side > 0 and not all(from_text):
            # greedy: a head row verifies its offered text tree (its first ``side`` nodes) beside
            # the head's chain, merged where they agree: exact (greedy verification follows the
            # target's argmax down any tree of fixed tokens); one host copy of the head's drafts
            chains, counts = drafted.tokens.tolist(), drafted.num_draft.tolist()
            trees = [tree if text else with_chain(self.text.offered[r], side, chains[r][:counts[r]])
                     for r, (tree, text) in enumerate(zip(trees, from_text))]
            proposal, depths = tree_proposal(trees, device, from_text=from_text)
            proposal.from_cache = list(self.text.from_cache)
            self.policy.proposed(depths)
            return proposal
        trees = [tree if text else ([-1] * (k + 1), [-1] + list(range(k)))  # a chain for the head's drafts
                 for tree, text in zip(trees, from_text)]
        proposal, depths = tree_proposal(trees, device, from_text=from_text)
        proposal.from_cache = list(self.text.from_cache)
        self.policy.proposed(depths)
        if all(from_text):
            return proposal
        by_text = torch.tensor(from_text, device=device)
        proposal.tokens[:, 1:k + 1] = torch.where(by_text[:, None], proposal.tokens[:, 1:k + 1], drafted.tokens)
        proposal.num_draft = torch.where(by_text, proposal.num_draft, drafted.num_draft)
        proposal.max_depth = max(proposal.max_depth, k)
        if drafted.q is not None:  # node i's child (node i + 1) of a head row was drawn from q[:, i]
            proposal.q = F.pad(drafted.q, (0, 0, 0, proposal.tokens.shape[1] - k))
            proposal.sampled_rows = ~by_text if any(from_text) else None
        return proposal

    def commit(self, outcome: Outcome) -> None:
        self.text.commit(outcome)
        self.head.commit(outcome)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.text.keep_rows(rows, index)
        self.head.keep_rows(rows, index)


def with_chain(tree: tuple[list[int], list[int]], side: int, chain: list[int]) -> tuple[list[int], list[int]]:
    """The first ``side`` nodes past the root of ``tree`` (tokens, parents; parents before
    children, so any prefix is a tree) with ``chain`` (host token list) hung from the root,
    sharing the tree's nodes as far as they agree (no two siblings with one token).

    Example:
        >>> with_chain(([-1, 7, 8, 9], [-1, 0, 1, 0]), 3, [7, 5])
        ([-1, 7, 8, 9, 5], [-1, 0, 1, 0, 1])
    """
    tokens, parents = list(tree[0][:side + 1]), list(tree[1][:side + 1])
    node = 0
    for token in chain:
        child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == token), None)
        if child is None:
            tokens.append(int(token))
            parents.append(node)
            child = len(tokens) - 1
        node = child
    return tokens, parents
