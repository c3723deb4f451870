"""A draft model: a transformers causal LM with the target's tokenizer drafts a chain (as
long as the length policy says), a static top-k tree (the policy's ``branching``) or
EAGLE-2's dynamic tree (``DynamicTree``)."""
from __future__ import annotations

import torch
from torch import Tensor

from spec_ext.drafters.base import (Drafter, Outcome, Proposal, Sampler, check_finite, draft_chain, grow_dynamic_tree,
                                    grow_static_tree, pad_rows, prefill)
from spec_ext.models import SpecCache, forward
from spec_ext.policies import Policy


class ModelDrafter(Drafter):
    """Drafts with ``model`` over its own :class:`SpecCache`.

    Cache convention: the draft's cache holds a prefix of the committed tokens; what it has
    not seen (the last round's accepted drafts it was not fed, the corrected or bonus token)
    waits on the device (the carry) and is fed at the start of the next round, whose last
    logits propose the first draft. One forward per further draft step (a chain) or per
    tree level (a tree: the tree so far, re-fed with tree attention).

    Example:
        >>> drafter = ModelDrafter(draft, spec_ext.policies.Fixed(4))            # doctest: +SKIP
        >>> spec_ext.generate(target, drafter, ids).stats.draft_calls            # doctest: +SKIP
    """

    def __init__(self, model, policy: Policy):
        super().__init__(policy)
        self.model = model
        self.hidden = policy.uses_draft_hidden

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        self.sampler, self.generator, self.calls = sampler, generator, 0
        self.device = self.model.device
        self.cache = SpecCache.for_model(self.model, len(seqs), capacity)
        self._carry: dict | None = None
        self.all_accepted = self.bonus_p = None

    def prefill(self, rows: list[list[int]]) -> None:
        """Feed ``rows`` (ragged, from position 0) to the draft's cache in one forward: the
        parallel engine's lanes start so; the serial rounds feed the prompt as a catch-up."""
        if prefill(self.model, self.cache, rows, "draft") is not None:
            self.calls += 1

    def forward(self, ids: Tensor, positions: Tensor, mask: Tensor | None = None):
        """The draft's logits [B,T,V] (and hidden states [B,T,H] for policies that read them)."""
        self.calls += 1
        return forward(self.model, ids, self.cache, positions, mask, self.hidden)

    def propose(self, seqs: list[list[int]], roots: Tensor) -> Proposal:
        if self.policy.branching is not None:
            return self.tree(seqs, roots)
        if self.policy.grows_dynamic_tree:
            return self.dynamic_tree(seqs, roots)
        drafts, q, num_draft, confidence = self.chain(seqs)
        return Proposal(drafts, num_draft, q, confidence=confidence)

    # ------------------------------------------------------------------ shapes
    def chain(self, seqs: list[list[int]], budget: list[int] | None = None, forced: Tensor | None = None,
              forced_rows: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """Draft up to ``budget[b]`` tokens per row (None: the policy's ``plan()``), stopping a
        row where the policy's ``keep_drafting`` says. ``forced_rows`` [B] bool: the rows whose
        drafts come from elsewhere; ``forced`` [B,k] their tokens, which replace the drafts
        there and are fed to the draft, so its cache keeps what the target accepts there
        (None: its own drafts stand there; the caller discards them and names the rows it
        verifies with :meth:`feeds`). Returns drafts [B,K] (-1 padded), the q [B,K,V]
        each was drawn from (None when greedy), num_draft [B] and each draft's confidence
        [B,K] (:func:`~spec_ext.drafters.base.draft_chain`)."""
        logits, hidden = self._catch_up(seqs)
        B = len(seqs)

        def step(token: Tensor) -> tuple[Tensor, Tensor | None]:
            out = self.forward(token.clamp_min(0)[:, None], self.cache.lengths[:, None])
            self.cache.advance([1] * B)
            return (out[0][:, 0], out[1][:, 0]) if self.hidden else (out[:, 0], None)

        drafts, q, num_draft, confidence = draft_chain(self.policy, self.sampler, self.generator, logits, hidden, step,
                                           self.policy.plan() if budget is None else budget, forced, forced_rows)
        self.feeds(drafts.shape[1] - 1)
        return drafts, q, num_draft, confidence

    def tree(self, seqs: list[list[int]], roots: Tensor) -> Proposal:
        """The policy's static tree (:func:`~spec_ext.drafters.base.grow_static_tree`), the
        tree so far re-fed with tree attention at each level."""
        logits, _ = self._catch_up(seqs)
        proposal = grow_static_tree(self.policy, logits, roots, self._refeed, self.sampler)
        self.feeds(0)  # the cache holds the committed tokens up to the root: none of the tree
        return proposal

    def _refeed(self, tokens: Tensor, parents: Tensor, depth: Tensor, mask: Tensor) -> Tensor:
        """Logits [B,n,V] at every node of a tree re-fed after the committed tokens (the root,
        the last committed token, at its own position again)."""
        self.cache.rollback([x - 1 for x in self.cache.host_lengths])
        out = self.forward(tokens, self.cache.lengths[:, None] + depth, mask)
        self.cache.advance([1] * len(tokens))
        return out[0] if self.hidden else out

    def dynamic_tree(self, seqs: list[list[int]], roots: Tensor) -> Proposal:
        """EAGLE-2's tree (:func:`~spec_ext.drafters.base.grow_dynamic_tree`)."""
        logits, _ = self._catch_up(seqs)
        proposal = grow_dynamic_tree(self.policy, logits, roots, self._refeed, self.sampler)
        self.feeds(0)
        return proposal

    # ------------------------------------------------------------------ state
    def feeds(self, drafts: int, rows: Tensor | None = None, rows_host: list[bool] | None = None) -> None:
        """This round fed every row ``drafts`` tokens past the committed ones, of which the
        drafts of ``rows`` [B] bool (``rows_host`` the same on the host; None: every row) are
        what the target verifies: :meth:`commit` keeps those it accepts."""
        self._fed = drafts, rows, rows_host

    def skip(self) -> None:
        """This round the draft proposed nothing (another drafter's round): it catches up
        from the committed text next time."""
        self._carry, self._fed = None, None

    def commit(self, outcome: Outcome) -> None:
        if self._fed is None:
            return
        limit, rows, rows_host = self._fed
        fed_t = outcome.num_accepted.clamp_max(limit)
        fed = [min(a, limit) for a in outcome.accepted]
        if rows is not None:
            fed_t = torch.where(rows, fed_t, 0)
            fed = [f if on else 0 for f, on in zip(fed, rows_host)]
        # every row was fed ``limit`` tokens past the catch-up; keep those the target accepted
        self.cache.rollback([n - limit + f for n, f in zip(self.cache.host_lengths, fed)],
                            self.cache.lengths - limit + fed_t)
        # the tokens the draft has not seen, tokens[b, fed[b] .. num_accepted[b]]; the last is the next root
        lengths = [a - f + 1 for f, a in zip(fed, outcome.accepted)]
        index = (fed_t[:, None] + torch.arange(max(lengths), device=self.device)).clamp_max(outcome.tokens.shape[1] - 1)
        self._carry = dict(ids=outcome.tokens.gather(1, index).clamp_min(0), lengths=lengths,
                           last=outcome.num_accepted - fed_t)
        if self.policy.uses_bonus_agreement:
            self.remember_bonus(outcome)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.cache.keep_rows(rows)
        if self._carry is not None:
            self._carry = {k: [v[i] for i in rows] if k == "lengths" else v[index] for k, v in self._carry.items()}
        self.keep_bonus_rows(index)

    def _catch_up(self, seqs: list[list[int]]) -> tuple[Tensor, Tensor | None]:
        """Feed the draft the committed tokens it has not seen (the carry, on the device; the
        first round or after a skip: from the host lists); logits [B,V] after the last (and
        the hidden state [B,H] that produced them, for policies that need it)."""
        carry, self._carry = self._carry, None
        if carry is None:
            pending = [s[n:] for s, n in zip(seqs, self.cache.host_lengths)]
            ids, lengths = pad_rows(pending, 0, self.device), [len(p) for p in pending]
            last = torch.tensor([n - 1 for n in lengths], device=self.device)
        else:
            ids, lengths, last = carry["ids"], carry["lengths"], carry["last"]
        # every row writes the padded width from its own length: after skipped rounds the rows' pending
        # tokens differ by more than one round's drafts, which the capacity was sized for (the drafts past
        # each row's own tokens still fit it)
        self.cache.reserve(max(self.cache.host_lengths) + ids.shape[1])
        positions = self.cache.lengths[:, None] + torch.arange(ids.shape[1], device=self.device)
        out = self.forward(ids, positions)
        logits, hidden = out if self.hidden else (out, None)
        if self.calls == 1:  # the prompt
            check_finite(logits, "draft")
        self.cache.advance(lengths, last + 1)
        if self.policy.uses_bonus_agreement:
            self.policy.see_bonus_agreement(self.bonus_agreement(logits, ids, last))
        rows = torch.arange(len(lengths), device=self.device)
        return logits[rows, last], None if hidden is None else hidden[rows, last]
