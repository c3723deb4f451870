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
from spec_ext.drafters.text_first import TextFirst
from spec_ext.policies.suffix import best_nodes, node_shares


class TextBesideHead(Drafter):
    """Each row drafts its text's tree (:class:`TextDrafter` under a
    :class:`~spec_ext.policies.Suffix` policy: the cache's tree, or the row's own text's, where
    the policy's ``text_rows`` expects it to get more accepted than the head, measured: see
    :meth:`~spec_ext.policies.Suffix.measured_choice`); the other rows take the head's chain of
    the length ``policy.plan()`` chooses (:class:`HeadDrafter`; timed here), verified with the q it was drawn from, as a chain
    among the text's trees. The head's catch-up feeds it the target's features of what was
    committed, whoever drafted it, so it stays in step; a round where every row drafts its text
    runs no head forward (:meth:`HeadDrafter.skip`: the next catch-up covers it).

    Greedy, once the round's costs are timed, the policy prices the round's width
    (:meth:`~spec_ext.policies.Suffix.priced`): a text row verifies its tree's best nodes up to
    the width that pays, a head row the branch of its offered tree beside the head's chain
    likewise; each round's width is reported (:meth:`~spec_ext.policies.Suffix.verifies`).

    Under the measured rule, a round where no row's cache tree is expected to beat the head
    (:meth:`~spec_ext.policies.Suffix.cache_adds`) is the default's instead
    (:meth:`~spec_ext.policies.Suffix.as_auto`): :class:`TextFirst` with the policy's
    :attr:`~spec_ext.policies.Suffix.model_chain` (an ``Auto``) choosing per row between the
    row's own text chain and the head, as the head without a cache drafts."""

    def __init__(self, text: TextDrafter, head: HeadDrafter):
        super().__init__(text.policy)
        self.text, self.head = text, head
        self.model = head.model
        chooser = text.policy.model_chain  # without its text (text=False): no round is the default's
        self.default = None if chooser.text_beside_draft is None else \
            TextFirst(TextDrafter(chooser.text_beside_draft), head, chooser=chooser)

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
        (self.default or self.head).start(seqs, capacity, sampler, generator, features=features)

    def propose(self, seqs: list[list[int]], roots: Tensor) -> Proposal:
        device = roots.device
        policy = self.policy
        trees = None
        if self.default is not None and policy.measured:  # the default's round unless the cache adds
            lengths = [policy.cache.match_length(match) for match in self.text.matches]
            if policy.cache_may_add(lengths, policy.cache_nodes()):  # (else no tree is grown)
                trees = self.text.trees()
            if trees is None or not policy.cache_adds():
                policy.as_auto()
                return self.default.propose(seqs, roots)
        policy.begin_round()  # price_width: the head's chain length, and the round's clock, before the head runs
        # the rule decides with this round's chain length (trees grown for the gate are ruled again)
        trees = self.text.trees() if trees is None else self.text.ruled()
        offered, sides, probs = self.text.offered, None, None
        if policy.pricing:  # the width that pays (greedy, timed): which rows, how many nodes
            self._own_instead()
            probs = self._offered_probs()
            priced = policy.priced(probs, [tree_depths(tree[1])[1:] for tree in offered])
            if priced is not None:
                keep, sides = priced
                trees = [best_nodes(offered[r], probs[r], m) if m else ([-1], [-1]) for r, m in enumerate(keep)]
                self.text.from_cache = [bool(m) and policy.offers[r][0] for r, m in enumerate(keep)]
        from_text = [len(tokens) > 1 for tokens, _ in trees]
        policy.proposed([int(text) for text in from_text])  # the head's plan: none when all rows have text
        drafted, k = None, 0
        if all(from_text) and not self.head.drafts_every_round:
            self.head.skip()  # no head forward: it catches up over this round in its next one
            policy.plan()  # the round's plan consumed (and, unpriced, its clock ticked) as the head's would be
        else:
            prompt = self.head.calls == 0  # its first forward reads the whole prompt: no forward's cost
            started = time.perf_counter()
            drafted = self.head.propose(seqs, roots)
            k = drafted.tokens.shape[1]
            policy.drafted(time.perf_counter() - started, max(k, 1), averaged=not prompt)  # prices the chain
        side = min(getattr(policy, "branch_nodes", 0), policy.tree_budget()[1] - 1 - k)
        if not all(from_text) and drafted.q is None and side > 0:
            # greedy: a head row verifies its offered text tree (its first ``side`` nodes, or the
            # best ones as priced) beside the head's chain, merged where they agree: exact (greedy
            # verification follows the target's argmax down any tree of fixed tokens); one host
            # copy of the head's drafts
            chains, counts = drafted.tokens.tolist(), drafted.num_draft.tolist()

            def branch(r: int) -> tuple[list[int], list[int], list[int]]:
                if sides is None:
                    return with_chain(offered[r], side, chains[r][:counts[r]], nodes=True)
                s = min(sides[r], side)
                return with_chain(best_nodes(offered[r], probs[r], s), s, chains[r][:counts[r]], nodes=True)
            merged = [None if text else branch(r) for r, text in enumerate(from_text)]
            trees = [tree if m is None else m[:2] for tree, m in zip(trees, merged)]
            proposal, depths = tree_proposal(trees, device, from_text=from_text)
            proposal.from_cache = list(self.text.from_cache)
            policy.proposed(depths)
            policy.verifies(proposal.tokens.shape[1], [None if m is None else m[2] for m in merged],
                            None if sides is None else [0 if text else min(sides[r], side)
                                                        for r, text in enumerate(from_text)])
            return proposal
        trees = [tree if text else ([-1] * (k + 1), [-1] + list(range(k)))  # a chain for the head's drafts
                 for tree, text in zip(trees, from_text)]
        proposal, depths = tree_proposal(trees, device, from_text=from_text)
        proposal.from_cache = list(self.text.from_cache)
        policy.proposed(depths)
        policy.verifies(proposal.tokens.shape[1], [None if text else list(range(1, k + 1)) for text in from_text])
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

    def _own_instead(self) -> None:
        """(Priced rounds.) A row offered its cache tree (the cache's match longer than its own
        text's n-gram) offers its own text's tree instead where that one is expected to get
        more accepted (:meth:`~spec_ext.policies.Suffix.expected`: a cache match of a few tokens
        is seldom right, measured, while the row's own text may be repeating itself)."""
        policy, text = self.policy, self.text
        if not policy.uses_own_text:
            return
        for r, offer in enumerate(policy.offers):
            if offer is None or not offer[0] or text.own[r] is None:
                continue
            tokens, parents, n, score, _ = text.own[r]
            if len(tokens) > 1 and policy.expected(r, False, n, score) > policy.expected(r, True, offer[1], offer[2]):
                text.offered[r] = (tokens, parents)
                policy.offers[r] = (False, n, score)

    def _offered_probs(self) -> list[list[float]]:
        """Per row, its offered text tree's nodes' probabilities (node 1 on; [] for none): the
        cache's as its lookup left them, the own text's from the continuations it was merged from."""
        policy, text = self.policy, self.text
        probs = []
        for r, (tree, offer) in enumerate(zip(text.offered, policy.offers)):
            if offer is None or len(tree[0]) <= 1:
                probs.append([])
            elif offer[0]:
                probs.append(list(text.matches[r].node_probs))
            else:  # the own text's tree, from the continuations the round merged it from
                probs.append(node_shares(tree, text.own[r][4]))
        return probs

    def commit(self, outcome: Outcome) -> None:
        self.text.commit(outcome)
        (self.default or self.head).commit(outcome)  # the default's: its text's and the head's

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.text.keep_rows(rows, index)
        (self.default or self.head).keep_rows(rows, index)


def with_chain(tree: tuple[list[int], list[int]], side: int, chain: list[int], nodes: bool = False) -> tuple:
    """The first ``side`` nodes past the root of ``tree`` (tokens, parents; parents before
    children, so any prefix is a tree) with ``chain`` (host token list) hung from the root,
    sharing the tree's nodes as far as they agree (no two siblings with one token). ``nodes``:
    also the chain's node ids, in order.

    Example:
        >>> with_chain(([-1, 7, 8, 9], [-1, 0, 1, 0]), 3, [7, 5])
        ([-1, 7, 8, 9, 5], [-1, 0, 1, 0, 1])
        >>> with_chain(([-1, 7, 8, 9], [-1, 0, 1, 0]), 3, [7, 5], nodes=True)[2]
        [1, 4]
    """
    tokens, parents = list(tree[0][:side + 1]), list(tree[1][:side + 1])
    node, ids = 0, []
    for token in chain:
        child = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == token), None)
        if child is None:
            tokens.append(int(token))
            parents.append(node)
            child = len(tokens) - 1
        node = child
        ids.append(node)
    return (tokens, parents, ids) if nodes else (tokens, parents)


def tree_depths(parents: list[int]) -> list[int]:
    """Each node's depth (the root 0; parents before children).

    Example:
        >>> tree_depths([-1, 0, 1, 0])
        [0, 1, 2, 1]
    """
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth
