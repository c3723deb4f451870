"""The text first, a draft model for the rows the text has no match for (``NGram`` beside a
draft model): one proposal, one target forward for both kinds of row."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler
from spec_ext.drafters.text import TextDrafter, chain_proposal, tree_proposal


class TextFirst(Drafter):
    """Each row drafts from its text (:class:`TextDrafter`); in a round where some row has
    no match, the draft model (:class:`ModelDrafter`, or :class:`OtherTokenizerDrafter` for
    a draft of another tokenizer) drafts ``policy.draft_k`` tokens for those rows. Chains:
    the draft model's steps are fed the text's drafts on the matched rows, so its cache
    keeps what the target accepts there too (a draft of another tokenizer re-tokenises the
    committed text each round instead); their q is one-hot.
    Trees: the model's rows are chains among the text's trees, verified with the q they
    were drawn from, the text's rows as deterministic trees.

    With a ``chooser`` (a policy with ``choose``, ``drafted``, ``draft_forwards`` and
    ``observe_text``: :class:`spec_ext.policies.Auto`),
    the chooser decides each round, from the text's match lengths, which rows draft their
    text (cut to what length) and how many drafts the model makes for the others (0: the
    model does not run); the drafter reports the seconds of the model's forwards to it.
    The model side may then also be a feature head (:class:`HeadDrafter`), whose state
    follows the target's features whatever was drafted: in a round where the model drafts
    its catch-up runs and the text's rows replace its drafts; in a round where only the text
    drafts it runs nothing (:meth:`HeadDrafter.skip`) and catches up over that round later
    (MTP layers, ``drafts_every_round``, catch up every round)."""

    def __init__(self, text: TextDrafter, model: Drafter, chooser=None):
        super().__init__(text.policy)
        self.text, self.model_drafter, self.chooser = text, model, chooser
        self.model = model.model
        if not hasattr(model, "chain") and chooser is None:
            raise ValueError(f"draft: {type(model).__name__} drafts beside the text only under a policy that "
                             f"chooses per row (Auto)")

    @property
    def calls(self) -> int:
        return self.model_drafter.calls

    @property
    def proposer(self):
        return self.model_drafter.proposer

    @property
    def drafts_per_forward(self) -> int:
        return self.model_drafter.drafts_per_forward

    @property
    def target_layers(self):
        return self.model_drafter.target_layers

    def bind(self, target) -> None:
        self.model_drafter.bind(target)

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        self.text.start(seqs, capacity, sampler, generator)
        self.model_drafter.start(seqs, capacity, sampler, generator, features=features)
        self._model_prefilled = False  # the model's first forward reads the whole prompt
        self._plain_skipped = False  # the last round was a plain step, which the model did not see
        self._unused: list[list[int]] = []

    def propose(self, seqs: list[list[int]], roots: Tensor) -> Proposal:
        if self.chooser is not None:
            return self._chosen(seqs, roots)
        B, k, device = len(seqs), self.policy.draft_k, roots.device
        if self.policy.tree:
            trees = self.text.trees()
            from_text = [len(tokens) > 1 for tokens, _ in trees]
            trees = [tree if text else ([-1] * (k + 1), [-1] + list(range(k)))  # a chain for the model to fill
                     for tree, text in zip(trees, from_text)]
            proposal, depths = tree_proposal(trees, device, from_text=from_text)
            proposal.from_cache = list(self.text.from_cache)
            self.policy.proposed(depths)
        else:
            proposal = self.text.propose(seqs, roots)
        if all(proposal.from_text):
            self.model_drafter.skip()
            return proposal
        by_text = torch.tensor(proposal.from_text, device=device)
        if proposal.is_tree:
            drafts, q, num = self.model_drafter.chain(seqs, [k] * B, forced_rows=by_text)[:3]
            self.model_drafter.feeds(drafts.shape[1] - 1, ~by_text, [not text for text in proposal.from_text])
            drafts = F.pad(drafts, (0, k - drafts.shape[1]), value=-1)  # a chain may stop short of k
            proposal.tokens[:, 1:k + 1] = torch.where(by_text[:, None], proposal.tokens[:, 1:k + 1], drafts)
            proposal.num_draft = torch.where(by_text, proposal.num_draft, num)
            proposal.max_depth = max(proposal.max_depth, k)
            if q is not None:  # node i's child (node i + 1) of a model row was drawn from q[:, i]
                proposal.q = F.pad(q, (0, 0, 0, proposal.tokens.shape[1] - q.shape[1]))
                proposal.sampled_rows = ~by_text if any(proposal.from_text) else None
            return proposal
        return self._beside(seqs, roots, proposal, by_text, k)

    def _beside(self, seqs: list[list[int]], roots: Tensor, proposal: Proposal, by_text: Tensor, k: int
                ) -> Proposal:
        """The model's chains of ``k`` for the rows not ``by_text`` [B] bool, the text's
        ``proposal`` (a chain) for the others, fed to the model (a drafter with ``chain``) or
        replacing its drafts (a feature head)."""
        B = len(seqs)
        K = max(k, proposal.tokens.shape[1])
        lookup = F.pad(proposal.tokens, (0, K - proposal.tokens.shape[1]), value=-1)
        if hasattr(self.model_drafter, "chain"):
            # past a text row's drafts the model is fed 0s (never verified: the row's tokens are the lookup's)
            drafts, q, num = self.model_drafter.chain(seqs, [k] * B, forced=lookup[:, :k].clamp_min(0),
                                                      forced_rows=by_text)[:3]
        else:  # the policy's plan() gives k (the chooser's)
            drafted = self.model_drafter.propose(seqs, roots)
            drafts, q, num = drafted.tokens, drafted.q, drafted.num_draft
        drafts = F.pad(drafts, (0, k - drafts.shape[1]), value=-1)[:, :k]
        tokens = torch.cat([torch.where(by_text[:, None], lookup[:, :k], drafts), lookup[:, k:]], 1)
        if q is not None:  # the text's drafts are deterministic: one-hot q
            q = F.pad(q, (0, 0, 0, K - q.shape[1]))[:, :K]
            one_hot = torch.zeros_like(q).scatter_(2, lookup.clamp_min(0)[..., None], 1.0)
            q = torch.where(by_text[:, None, None], one_hot, q)
        # the text's rows: all their drafts (past the k forced ones too); the model's: what it drafted
        return Proposal(tokens, torch.where(by_text, proposal.num_draft, num), q, from_text=proposal.from_text)

    def _chosen(self, seqs: list[list[int]], roots: Tensor) -> Proposal:
        """A round as the chooser decides it (chains)."""
        device = roots.device
        chains = self.text.chains()
        head = self.model_drafter.drafts_every_round
        k, use, cap = self.chooser.choose([len(c) for c in chains], forwards_without_model=int(head))
        self._unused = [[] if u else c for c, u in zip(chains, use)]  # the text offers not drafted
        chains = [c[:cap] if u else [] for c, u in zip(chains, use)]
        proposal = chain_proposal(chains, max(map(len, chains)), device)
        proposal.from_text = [bool(c) for c in chains]
        if k == 0 and not head:
            self.model_drafter.skip()
            self.chooser.plan()  # the round's choice consumed, as the model's propose would (a Suffix reads plan next)
            self._plain_skipped = not any(use)  # a plain step: the model's next forward catches up over it
            return proposal
        by_text = torch.tensor(proposal.from_text, device=device)
        started = time.perf_counter()
        proposal = self._beside(seqs, roots, proposal, by_text, k)
        # the round that also prefilled the model's cache is taken out of the round's time, not
        # into one forward's cost (that prefill made a forward look 2x its cost for the first
        # ~20 rounds, so Auto drafted short); so is the first after plain steps (a catch-up over
        # them: counted as forwards, it kept D high while plain steps won, which kept them winning)
        self.chooser.drafted(time.perf_counter() - started, max(self.chooser.draft_forwards(k), int(head)),
                             averaged=self._model_prefilled and not self._plain_skipped)
        self._model_prefilled, self._plain_skipped = True, False
        return proposal

    def commit(self, outcome: Outcome) -> None:
        if self.chooser is not None and any(self._unused):  # the text's runs where it did not draft
            compared = [min(len(c), len(t)) for c, t in zip(self._unused, outcome.committed)]
            runs = [next((j for j in range(n) if c[j] != t[j]), n)
                    for c, t, n in zip(self._unused, outcome.committed, compared)]
            self.chooser.observe_text(compared, runs)
        self._unused = []
        self.text.commit(outcome)
        self.model_drafter.commit(outcome)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.text.keep_rows(rows, index)
        self.model_drafter.keep_rows(rows, index)
