"""The text first, a draft model for the rows the text has no match for (``NGram`` beside a
draft model): one proposal, one target forward for both kinds of row."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler
from spec_ext.drafters.model import ModelDrafter
from spec_ext.drafters.other_tokenizer import OtherTokenizerDrafter
from spec_ext.drafters.text import TextDrafter, tree_proposal


class TextFirst(Drafter):
    """Each row drafts from its text (:class:`TextDrafter`); in a round where some row has
    no match, the draft model (:class:`ModelDrafter`, or :class:`OtherTokenizerDrafter` for
    a draft of another tokenizer) drafts ``policy.draft_k`` tokens for those rows. Chains:
    the draft model's steps are fed the text's drafts on the matched rows, so its cache
    keeps what the target accepts there too (a draft of another tokenizer re-tokenises the
    committed text each round instead); their q is one-hot.
    Trees: the model's rows are chains among the text's trees, verified with the q they
    were drawn from, the text's rows as deterministic trees."""

    def __init__(self, text: TextDrafter, model: ModelDrafter | OtherTokenizerDrafter):
        super().__init__(text.policy)
        self.text, self.model_drafter = text, model
        self.model = model.model

    @property
    def calls(self) -> int:
        return self.model_drafter.calls

    def bind(self, target) -> None:
        self.model_drafter.bind(target)

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        self.text.start(seqs, capacity, sampler, generator)
        self.model_drafter.start(seqs, capacity, sampler, generator)

    def propose(self, seqs: list[list[int]], roots: Tensor) -> Proposal:
        B, k, device = len(seqs), self.policy.draft_k, roots.device
        if self.policy.tree:
            trees = self.text.trees()
            from_text = [len(tokens) > 1 for tokens, _ in trees]
            trees = [tree if text else ([-1] * (k + 1), [-1] + list(range(k)))  # a chain for the model to fill
                     for tree, text in zip(trees, from_text)]
            proposal, depths = tree_proposal(trees, device, from_text=from_text)
            self.policy.proposed(depths)
        else:
            proposal = self.text.propose(seqs, roots)
        if all(proposal.from_text):
            self.model_drafter.skip()
            return proposal
        by_text = torch.tensor(proposal.from_text, device=device)
        if proposal.is_tree:
            drafts, q, num = self.model_drafter.chain(seqs, [k] * B, forced_rows=by_text)
            self.model_drafter.feeds(drafts.shape[1] - 1, ~by_text, [not text for text in proposal.from_text])
            drafts = F.pad(drafts, (0, k - drafts.shape[1]), value=-1)  # a chain may stop short of k
            proposal.tokens[:, 1:k + 1] = torch.where(by_text[:, None], proposal.tokens[:, 1:k + 1], drafts)
            proposal.num_draft = torch.where(by_text, proposal.num_draft, num)
            proposal.max_depth = max(proposal.max_depth, k)
            if q is not None:  # node i's child (node i + 1) of a model row was drawn from q[:, i]
                proposal.q = F.pad(q, (0, 0, 0, proposal.tokens.shape[1] - q.shape[1]))
                proposal.sampled_rows = ~by_text if any(proposal.from_text) else None
            return proposal
        K = max(k, proposal.tokens.shape[1])
        lookup = F.pad(proposal.tokens, (0, K - proposal.tokens.shape[1]), value=-1)
        drafts, q, num = self.model_drafter.chain(seqs, [k] * B, forced=lookup[:, :k], forced_rows=by_text)
        tokens = torch.cat([F.pad(drafts, (0, k - drafts.shape[1]), value=-1), lookup[:, k:]], 1)
        if q is not None:  # the text's drafts are deterministic: one-hot q
            q = F.pad(q, (0, 0, 0, K - q.shape[1]))
            one_hot = torch.zeros_like(q).scatter_(2, lookup.clamp_min(0)[..., None], 1.0)
            q = torch.where(by_text[:, None, None], one_hot, q)
        # the text's rows: all their drafts (past the k forced ones too); the model's: what it drafted
        return Proposal(tokens, torch.where(by_text, proposal.num_draft, num), q, from_text=proposal.from_text)

    def commit(self, outcome: Outcome) -> None:
        self.text.commit(outcome)
        self.model_drafter.commit(outcome)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.text.keep_rows(rows, index)
        self.model_drafter.keep_rows(rows, index)
