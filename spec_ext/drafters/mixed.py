"""One drafter for every call: per row, the model drafts it, its text does (its own prompt and
output, or a suffix cache's earlier requests), or nothing, as the round's plan says; the rows
are merged into one :class:`Proposal` (:func:`merge`), verified in one target forward."""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler
from spec_ext.drafters.text import TextSource, chain_proposal, tree_proposal
from spec_ext.policies import Offer, RoundPlan


class MixedDrafter:
    """The call's drafting: ``model`` (a :class:`Drafter`; None: the text alone) and ``text``
    (a :class:`TextSource`; None: the model alone). The engine reads ``text`` (the
    controllers' lookups) and drives :meth:`propose` with each round's plan.

    A round where the model drafts no row runs no model forward (:meth:`Drafter.skip`: it
    catches up over that round in its next), except for a drafter that ``drafts_every_round``
    (MTP layers, whose catch-up is the round's forward). Where text rows are chains beside the
    model's chains, a drafter with a draft cache is fed their tokens (``forced``), so its
    cache keeps what the target accepts there too."""

    def __init__(self, model: Drafter | None, text: TextSource | None):
        self.model_drafter, self.text = model, text
        self.ran_last = False  # the model's last round ran its forwards (its next is a step's cost)

    @property
    def calls(self) -> int:
        return 0 if self.model_drafter is None else self.model_drafter.calls

    @property
    def target_layers(self):
        return None if self.model_drafter is None else self.model_drafter.target_layers

    @property
    def proposer(self):
        return None if self.model_drafter is None else self.model_drafter.proposer

    def bind(self, target) -> None:
        if self.model_drafter is not None:
            self.model_drafter.bind(target)

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        if self.text is not None:
            self.text.start(seqs)
        if self.model_drafter is not None:
            self.model_drafter.start(seqs, capacity, sampler, generator, features=features)
        self.ran_last = False

    def propose(self, seqs: list[list[int]], roots: Tensor, plan: RoundPlan) -> Proposal:
        model, drafted = self.model_drafter, None
        started, calls = time.perf_counter(), self.calls
        if model is not None and (plan.model_runs or model.drafts_every_round):
            text_rows = [t is not None for t in plan.text]
            if any(text_rows):
                by_text = torch.tensor(text_rows, device=roots.device)
                forced = None
                if all(t is None or t.parents is None for t in plan.text):  # fed to a drafter with a cache
                    K = max(plan.k)
                    forced = torch.tensor([list(t.tokens[:K]) + [0] * (K - len(t.tokens[:K])) if t else [0] * K
                                           for t in plan.text], device=roots.device).view(len(seqs), K)
                    plan = dataclasses.replace(plan, k=[K if t else k for t, k in zip(text_rows, plan.k)])
                drafted = model.propose(seqs, roots, plan, forced, by_text)
            else:
                drafted = model.propose(seqs, roots, plan)
        elif model is not None:
            model.skip()
        proposal = merge(plan, drafted, roots.device)
        proposal.source = plan.sources
        proposal.draft_forwards = self.calls - calls
        if proposal.draft_forwards:
            proposal.draft_seconds = time.perf_counter() - started
            proposal.draft_steps = drafted.draft_steps or (plan.tree.max_depth if plan.tree is not None
                                                           else drafted.tokens.shape[1])
            proposal.warm = self.ran_last
        self.ran_last = proposal.draft_forwards > 0
        return proposal

    def skip(self) -> None:
        """A round nothing drafts (a plain step): the model catches up over it in its next."""
        if self.model_drafter is not None:
            self.model_drafter.skip()
        self.ran_last = False

    def commit(self, outcome: Outcome) -> None:
        if self.text is not None:
            self.text.commit(outcome)
        if self.model_drafter is not None:
            self.model_drafter.commit(outcome)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        if self.text is not None:
            self.text.keep_rows(rows)
        if self.model_drafter is not None:
            self.model_drafter.keep_rows(rows, index)


def merge(plan: RoundPlan, model: Proposal | None, device) -> Proposal:
    """One proposal of the round's rows: row b's text drafts ``plan.text[b]`` where set, else
    the model's drafts (``model``: the model drafter's proposal of every row, None where it did
    not run). Chains beside chains stay a chain (the text's deterministic drafts verified with
    one-hot q beside the model's sampled ones); a text tree beside model chains makes every
    row a tree, the model's chains hung from their roots, verified with the q they were drawn
    from (``sampled_rows``)."""
    B, text = plan.rows, plan.text
    if not any(t is not None for t in text):
        return model if model is not None else chain_proposal([[]] * B, 0, device)
    is_chain = [t is None or t.parents is None for t in text]
    if all(is_chain) and (model is None or not model.is_tree):
        chains = [list(t.tokens) if t is not None else [] for t in text]
        K = max(max(map(len, chains)), 0 if model is None else model.tokens.shape[1])
        lookup = chain_proposal(chains, K, device)
        if model is None:
            return lookup
        by_text = torch.tensor([t is not None for t in text], device=device)
        drafts = F.pad(model.tokens, (0, K - model.tokens.shape[1]), value=-1)
        q = model.q
        if q is not None:  # the text's drafts are deterministic: one-hot q
            q = F.pad(q, (0, 0, 0, K - q.shape[1]))
            one_hot = torch.zeros_like(q).scatter_(2, lookup.tokens.clamp_min(0)[..., None], 1.0)
            q = torch.where(by_text[:, None, None], one_hot, q)
        return Proposal(torch.where(by_text[:, None], lookup.tokens, drafts),
                        torch.where(by_text, lookup.num_draft, model.num_draft), q, explores=model.explores)
    K = 0 if model is None else model.tokens.shape[1]
    chain_of = lambda n: ([-1] * (n + 1), [-1] + list(range(n)))  # noqa: E731  a chain as a tree
    trees = [_as_tree(t) if t is not None else chain_of(K) for t in text]
    proposal = tree_proposal(trees, device, width=K + 1)
    if model is None or K == 0:
        return proposal
    by_text = torch.tensor([t is not None for t in text], device=device)
    proposal.tokens[:, 1:K + 1] = torch.where(by_text[:, None], proposal.tokens[:, 1:K + 1], model.tokens)
    proposal.num_draft = torch.where(by_text, proposal.num_draft, model.num_draft)
    proposal.max_depth = max(proposal.max_depth, K)
    if model.q is not None:  # node i's child (node i + 1) of a model row was drawn from q[:, i]
        proposal.q = F.pad(model.q, (0, 0, 0, proposal.tokens.shape[1] - K))
        proposal.sampled_rows = ~by_text
    proposal.explores = model.explores
    return proposal


def _as_tree(offer: Offer) -> tuple[list[int], list[int]]:
    """An offer as (tokens, parents) of a tree (a chain: each draft the child of the one before)."""
    if offer.parents is not None:
        return list(offer.tokens), list(offer.parents)
    n = len(offer.tokens)
    return [-1] + list(offer.tokens), [-1] + list(range(n))
