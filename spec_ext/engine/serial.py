"""The serial engine: the drafter-verifier loop on Hugging Face models, for ragged batches.

Each round, for every unfinished row at once: the drafter proposes a chain or a tree
(:class:`spec_ext.drafters.Proposal`), the policy selects what of it is verified
(``Policy.select``: all of it, or a prefix or subtree per row), the target verifies that in
one forward through :class:`SpecCache` and tree attention, a rejection sampler keeps what the target's
distribution allows, the target's cache keeps the accepted tokens and the drafter is told
what was kept. One host sync per round (the emitted tokens and counts), plus one per
draft step for length policies that decide on the host when to stop drafting.

Cache convention: the target cache holds every committed token but the last, which is
the root of the next verification (``roots``, kept on the device).
"""
from __future__ import annotations

import torch
from torch import Tensor

from spec_ext import ops
from spec_ext.drafters import Drafter, Outcome, Proposal, prefill
from spec_ext.engine.common import Rows, Stats
from spec_ext.models import SpecCache, forward
from spec_ext.policies import Policy
from spec_ext.processing import Positions


class SerialEngine(Rows):
    """Runs one generate call's rounds: whatever ``drafter`` proposes, a chain or a tree,
    is verified by one target forward; ``policy`` is told each round's outcome."""

    def __init__(self, target, drafter: Drafter, prompts, max_new_tokens, sampler, eos, policy: Policy, generator,
                 streamer):
        super().__init__(prompts, max_new_tokens, eos, streamer)
        self.target, self.drafter = target, drafter
        self.sampler, self.policy, self.generator = sampler, policy, generator
        self.device = target.device
        self.capacity = max(len(p) for p in prompts) + max_new_tokens + policy.max_draft + 2
        self.cache = SpecCache.for_model(target, len(prompts), self.capacity)
        self.target_hidden = policy.uses_target_hidden
        self.layers = drafter.target_layers
        self.roots = torch.tensor([p[-1] for p in prompts], device=self.device)

    def _outputs(self, out) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(logits, the last hidden state for the policy, the drafter's features) of a forward."""
        out = list(out) if self.target_hidden or self.layers is not None else [out]
        return out[0], out[1] if self.target_hidden else None, out[-1] if self.layers is not None else None

    def _target(self, ids: Tensor, positions: Tensor, mask=None):
        self.stats.target_calls += 1
        extra = {} if self.layers is None else dict(layers=self.layers)
        return self._outputs(forward(self.target, ids, self.cache, positions, mask, self.target_hidden, **extra))

    def prefill(self) -> Tensor | None:
        """The prompts but their last tokens into the target's cache; returns the drafter's
        features of them (None when it reads none)."""
        heads = [s[:-1] for s in self.seqs]
        out = prefill(self.target, self.cache, heads, "target", self.target_hidden, self.layers)
        if out is None:
            return None
        self.stats.target_calls += 1
        _, hidden, features = self._outputs(out)
        if self.target_hidden and min(map(len, heads)) > 0:  # one-token prompts: the policy's first guess
            last = torch.tensor([len(h) - 1 for h in heads], device=self.device)
            rows = torch.arange(len(heads), device=self.device)
            self.policy.see_target(hidden[rows, last], self.roots)
        return features

    def verify(self, proposal: Proposal) -> Outcome:
        """One target forward over the roots and the proposal, the sampler, the round's host
        sync, and the target cache's commit (a chain keeps a prefix, a tree its path)."""
        B = len(self.active)
        nodes = proposal.tokens
        if proposal.is_tree:
            nodes = proposal.tokens.clone()
            nodes[:, 0] = self.roots
            ids, positions = nodes.clamp_min(0), self.cache.lengths[:, None] + proposal.depth
        else:
            ids = torch.cat([self.roots[:, None], proposal.tokens.clamp_min(0)], 1)
            positions = self.cache.lengths[:, None] + torch.arange(ids.shape[1], device=self.device)
        logits, hidden, features = self._target(ids, positions, proposal.mask)
        if self.sampler.processors is not None:  # each position's prefix: the row's text, then its path
            logits = self.sampler.process(logits, Positions.tree(nodes, proposal.parents, proposal.depth,
                                                                 proposal.max_depth) if proposal.is_tree else
                                          Positions.chain(proposal.tokens, proposal.num_draft), check=True)
        p = None if self.sampler.greedy else self.sampler.probs(logits)
        # the loop builds the verification's inputs itself: no input checks (they cost 2.7% of
        # a greedy call at batch 1 on CPU); the models' logits were checked on the prompt
        result = self._sample(proposal, logits, p)
        rows = torch.arange(B, device=self.device)
        last = result.num_accepted if not proposal.is_tree else result.path[rows, result.num_accepted]
        if self.target_hidden:
            self.policy.see_target(hidden[rows, last], result.tokens[rows, result.num_accepted])
        # the round's one host sync: what was emitted (EOS, streaming, max_new_tokens)
        outcome = torch.cat([result.tokens, result.num_accepted[:, None], proposal.num_draft[:, None]], 1).tolist()
        accepted, drafted = [o[-2] for o in outcome], [o[-1] for o in outcome]
        if proposal.is_tree:
            self.cache.commit(result.path, accepted, result.num_accepted)
        else:
            self.cache.advance([a + 1 for a in accepted], result.num_accepted + 1)
        self.roots = result.tokens[rows, result.num_accepted]
        return Outcome(result.tokens, result.num_accepted, accepted, [o[:a + 1] for o, a in zip(outcome, accepted)],
                       proposal.num_draft, drafted, last, result.path if proposal.is_tree else None, p, features)

    def _sample(self, proposal: Proposal, logits: Tensor, p: Tensor | None):
        """The greedy or rejection-sampling verification of a chain or a tree."""
        if not proposal.is_tree:
            if p is None:
                return ops.greedy_verify(logits, proposal.tokens, proposal.num_draft, validate=False)
            return ops.chain_rejection_sample(p, proposal.tokens, proposal.q, proposal.num_draft,
                                              generator=self.generator, validate=False)
        tokens, parents, depth = proposal.tokens, proposal.parents, proposal.max_depth
        if p is None:
            return ops.tree_greedy_verify(logits, tokens, parents, max_depth=depth, validate=False)
        if proposal.q is None or proposal.sampled_rows is None:
            return ops.tree_rejection_sample(p, tokens, parents, proposal.q, generator=self.generator,
                                             max_depth=depth, validate=False)
        # rows whose drafts carry their q beside deterministic rows (one-hot q, siblings without
        # replacement): both verifications for every row, each row keeps its own (no host sync)
        drawn = ops.tree_rejection_sample(p, tokens, parents, proposal.q, generator=self.generator, max_depth=depth,
                                          validate=False)
        fixed = ops.tree_rejection_sample(p, tokens, parents, generator=self.generator, max_depth=depth,
                                          validate=False)
        rows = proposal.sampled_rows
        return ops.TreeResult(*(torch.where(rows[:, None] if a.dim() == 2 else rows, a, b)
                                for a, b in zip(drawn, fixed)))

    def run(self) -> Stats:
        self.policy.start(len(self.active), self.sampler.greedy)
        features = self.prefill()
        self.drafter.start([list(s) for s in self.seqs], self.capacity, self.sampler, self.generator,
                           features=features)
        while self.active:
            proposal = self.policy.select(self.drafter.propose([self.seqs[r] for r in self.active], self.roots))
            outcome = self.verify(proposal)
            if self.sampler.processors is not None:
                self.sampler.processors.commit(outcome.tokens, outcome.num_accepted + 1, outcome.committed)
            if not proposal.explores:
                if outcome.path is not None and self.policy.uses_tree_paths:
                    self.policy.see_tree_path(outcome.path)
                self.policy.observe(outcome.drafted, outcome.accepted)
            self.drafter.commit(outcome)
            from_text = proposal.from_text or [False] * len(self.active)
            from_cache = proposal.from_cache or [False] * len(self.active)
            keep = [i for i, r in enumerate(self.active)
                    if self.emit(r, outcome.committed[i], outcome.drafted[i], outcome.accepted[i], from_text[i],
                                 from_cache[i])]
            if len(keep) < len(self.active):
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                self.cache.keep_rows(keep)
                self.drafter.keep_rows(keep, index)
                self.policy.keep_rows(keep)
                if self.sampler.processors is not None:
                    self.sampler.processors.keep_rows(keep, index)
                self.roots = self.roots[index]
                self.active = [self.active[i] for i in keep]
        self.stats.draft_calls = self.drafter.calls
        return self.finish()
