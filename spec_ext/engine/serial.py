"""The serial engine: the drafter-verifier loop on Hugging Face models, for ragged batches.

Each round, for every unfinished row at once: the controller plans the round (per row, what
drafts it and how far), the drafter drafts by the plan (:class:`spec_ext.drafters.Proposal`,
a chain or a tree), the plan selects what of it is verified (all of it, or a prefix or
subtree per row), the target verifies that in one forward through :class:`SpecCache` and
tree attention, a rejection sampler keeps what the target's distribution allows, the target's
cache keeps the accepted tokens, the drafter is told what was kept and the controller what
the round gave. One host sync per round (the emitted tokens and counts), plus one per draft
step for plans that decide on the host when to stop drafting.

Cache convention: the target cache holds every committed token but the last, which is
the root of the next verification (``roots``, kept on the device).
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext import ops
from spec_ext.drafters import MixedDrafter, Outcome, Proposal, check_finite, pad_rows
from spec_ext.drafters.features import join_columns
from spec_ext.engine.common import Rows, lead_in
from spec_ext.models import Forward, SpecCache, forward
from spec_ext.policies import Controller, Policy, Report, RoundPlan, RoundState, Source
from spec_ext.processing import Positions


class SerialEngine(Rows):
    """Runs one generate call's rounds: ``controller`` (of ``policy``) plans each, ``drafter``
    proposes by the plan, one target forward verifies whatever it proposed."""

    def __init__(self, target, drafter: MixedDrafter, policy: Policy, controller: Controller, prompts,
                 max_new_tokens, sampler, eos, generator, streamer):
        super().__init__(prompts, max_new_tokens, eos, streamer)
        self.target, self.drafter, self.controller = target, drafter, controller
        self.sampler, self.generator = sampler, generator
        self.device = target.device
        self.capacity = max(len(p) for p in prompts) + max_new_tokens + policy.lookahead + 2
        self.cache = SpecCache.for_model(target, len(prompts), self.capacity)
        self.reads_target, self.drafts = policy.reads_target, policy.drafts
        self.layers = drafter.target_layers
        self.roots = torch.tensor([p[-1] for p in prompts], device=self.device)
        self.hidden: Tensor | None = None  # the target's last hidden state at each root (reads_target)
        self._plains: dict[int, Proposal] = {}
        self.prompt_features: Tensor | None = None  # (the first round) the target's features of every prompt token
        self.model_read = [0] * len(prompts)  # per row: its length when the model's drafter last read it

    def _target(self, ids: Tensor, positions: Tensor, mask=None, logits_at: Tensor | None = None) -> Forward:
        self.stats.target_calls += 1
        extra = {} if self.layers is None else dict(layers=self.layers)
        return forward(self.target, ids, self.cache, positions, mask, self.reads_target, logits_at=logits_at, **extra)

    def verify(self, proposal: Proposal, prompt: bool = False) -> Outcome:
        """One target forward over the roots and the proposal, the sampler, the round's host
        sync, and the target cache's commit (a chain keeps a prefix, a tree its path).
        ``prompt``: the call's first round, whose forward also reads every prompt token before
        the root (a chain: each row's prompt, then its drafts; the cache is empty before it)."""
        if not prompt and not proposal.is_tree and proposal.tokens.shape[1] == 0:
            return self._plain_step(proposal)
        B = len(self.active)
        nodes = proposal.tokens
        columns = None  # (prompt) each row's root and drafts among the forward's positions
        if proposal.is_tree:
            nodes = proposal.tokens.clone()
            nodes[:, 0] = self.roots
            ids, positions = nodes.clamp_min(0), self.cache.lengths[:, None] + proposal.depth
        elif prompt:  # (a long prompt's head first, in forwards of a bounded width)
            full = [self.seqs[r] for r in self.active]
            fed, lead, forwards = lead_in(self.target, self.cache, full, self.layers)
            self.stats.target_calls += forwards
            tails = [row[f:] for row, f in zip(full, fed)]
            K = proposal.tokens.shape[1]
            root = torch.tensor([len(tail) - 1 for tail in tails], device=self.device)
            columns = root[:, None] + torch.arange(K + 1, device=self.device)
            ids = F.pad(pad_rows(tails, 0, self.device), (0, K)).scatter(1, columns[:, 1:],
                                                                         proposal.tokens.clamp_min(0))
            positions = self.cache.lengths[:, None] + torch.arange(ids.shape[1], device=self.device)
        else:
            ids = torch.cat([self.roots[:, None], proposal.tokens.clamp_min(0)], 1)
            positions = self.cache.lengths[:, None] + torch.arange(ids.shape[1], device=self.device)
        logits, hidden, features = self._target(ids, positions, proposal.mask, logits_at=columns)
        if columns is not None:  # (the logits come at the roots and drafts alone)
            check_finite(logits, "target")  # once per call, at the prompt's last token and the drafts
            if features is not None:  # every prompt token's but the last: the lead-in's, then this forward's
                zero, rest = [0] * len(full), [len(row) - 1 - f for row, f in zip(full, fed)]
                self.prompt_features = features if lead is None else \
                    join_columns([((lead,), zero, fed), ((features,), zero, rest)])[0][0]
            hidden, features = (None if x is None else x.gather(1, columns[..., None].expand(-1, -1, x.shape[-1]))
                                for x in (hidden, features))
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
        if self.reads_target:
            self.hidden = hidden[rows, last]
        # the round's one host sync: what was emitted (EOS, streaming, max_new_tokens)
        outcome = torch.cat([result.tokens, result.num_accepted[:, None], proposal.num_draft[:, None]], 1).tolist()
        accepted, drafted = [o[-2] for o in outcome], [o[-1] for o in outcome]
        if proposal.is_tree:
            self.cache.commit(result.path, accepted, result.num_accepted)
        elif prompt:  # the prompt's tokens before the root, the root and the accepted drafts
            before = [len(tail) - 1 for tail in tails]
            self.cache.advance([n + a + 1 for n, a in zip(before, accepted)],
                               torch.tensor(before, device=self.device) + result.num_accepted + 1)
        else:
            self.cache.advance([a + 1 for a in accepted], result.num_accepted + 1)
        self.roots = result.tokens[rows, result.num_accepted]
        return Outcome(result.tokens, result.num_accepted, accepted, [o[:a + 1] for o, a in zip(outcome, accepted)],
                       proposal.num_draft, drafted, last, result.path if proposal.is_tree else None, p, features)

    def _run_plain(self):
        """The rounds after the first of a policy that never drafts (``Plain``): plain steps
        (:meth:`_plain_steps`) until every row is done, none of a round's planning."""
        while self.active:
            _, keep = self._plain_steps(None)
            self._keep_rows(keep, drafter=False)
        self.controller.finish()
        return self.finish()

    def _plain_steps(self, most: int | None) -> tuple[Outcome, list[int]]:
        """Plain steps (at most ``most``; None: no bound) until one where a row finishes, each
        step's tokens fed to the processors and emitted as it comes, and the rows that go on.
        The outcome: with ``most``, the steps' merged :class:`Outcome` (as a round that accepted
        all its steps' tokens but the last as drafts would give: what the drafter catches up on
        after them); without, the last step's (nothing of the others is kept)."""
        processors, steps = self.sampler.processors, []
        none = self._plain(len(self.active))
        keep = list(range(len(self.active)))
        while len(keep) == len(self.active) and (most is None or len(steps) < most):
            outcome = self._plain_step(none)
            steps = [*steps, outcome] if most is not None else [outcome]  # (runs are a few steps)
            if processors is not None:
                processors.commit(outcome.tokens, none.num_draft + 1, outcome.committed)
            keep = [i for i, r in enumerate(self.active) if self.emit(r, outcome.committed[i], 0, 0, "none")]
        if len(steps) == 1:
            return steps[0], keep
        B, n = len(self.active), len(steps)
        accepted = torch.full_like(none.num_draft, n - 1)

        def joined(name: str) -> Tensor | None:
            return None if getattr(steps[0], name) is None else torch.cat([getattr(o, name) for o in steps], 1)

        committed = [[token for step in row for token in step] for row in zip(*(o.committed for o in steps))]
        return Outcome(joined("tokens"), accepted, [n - 1] * B, committed, accepted, [n - 1] * B, accepted, None,
                       joined("p"), joined("features")), keep

    def _plain_step(self, none: Proposal) -> Outcome:
        """A plain decode step (``none``: the proposal of no drafts): one target forward at the
        roots and the sampler, none of the verification's machinery (a greedy token is the
        argmax, as the verification's would be)."""
        B, sampler = len(self.active), self.sampler
        logits, hidden, features = self._target(self.roots[:, None], self.cache.lengths[:, None])
        if sampler.processors is not None:
            logits = sampler.process(logits, Positions.chain(none.tokens, none.num_draft), check=True)
        p = None if sampler.greedy else sampler.probs(logits)
        token = logits[:, 0].argmax(-1) if p is None else \
            ops.chain_rejection_sample(p, none.tokens, None, none.num_draft, generator=self.generator,
                                       validate=False).tokens[:, 0]
        tokens = token.tolist()
        self.cache.advance([1] * B, none.num_draft + 1)
        self.roots = token
        if self.reads_target:
            self.hidden = hidden[:, 0]
        zeros = none.num_draft
        return Outcome(token[:, None], zeros, [0] * B, [[t] for t in tokens], zeros, [0] * B, zeros, None, p, features)

    def _plain(self, rows: int) -> Proposal:
        """A proposal of no drafts for ``rows`` rows (made once per batch size)."""
        if self._plains.get(rows) is None:
            self._plains[rows] = Proposal(torch.zeros(rows, 0, dtype=torch.int64, device=self.device),
                                          torch.zeros(rows, dtype=torch.int64, device=self.device),
                                          source=[Source.NONE] * rows)
        return self._plains[rows]

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

    def _keep_rows(self, keep: list[int], drafter: bool = True) -> None:
        """Only the rows ``keep`` (indices into the active rows) go on: every per-row state
        (``drafter``: the drafter's too) keeps them alone."""
        if len(keep) == len(self.active) or not keep:  # (no row left: the call ends)
            self.active = [self.active[i] for i in keep]
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.keep_rows(keep)
        if drafter:
            self.drafter.keep_rows(keep, index)
        self.controller.keep_rows(keep)
        if self.sampler.processors is not None:
            self.sampler.processors.keep_rows(keep, index)
        self.roots = self.roots[index]
        if self.hidden is not None:
            self.hidden = self.hidden[index]
        self.active = [self.active[i] for i in keep]

    def run(self):
        controller, drafter = self.controller, self.drafter
        # a drafter that reads the target's features starts once the prompt's forward gave them
        # (and the first new token: it drafts from there on); the others draft from the prompt,
        # their first drafts verified in the prompt's own forward
        waiting = self.layers is not None
        if not waiting:
            drafter.start([list(s) for s in self.seqs], self.capacity, self.sampler, self.generator)
        first = True
        while self.active:
            if not first and not self.drafts:
                return self._run_plain()
            started = time.perf_counter()
            seqs = [self.seqs[r] for r in self.active]
            B = len(seqs)
            model = drafter.model_drafter
            behind = None if model is None or model.drafts_every_round or model.reads_on_commit else \
                [len(s) - self.model_read[r] for r, s in zip(self.active, seqs)]
            plan = RoundPlan([0] * B) if waiting else \
                controller.plan(RoundState(B, drafter.text, self.hidden, self.roots,
                                           [self.max_new - len(self.new[r]) for r in self.active], behind))
            if first and plan.tree is not None:  # (trees are verified from the second round on)
                plan = RoundPlan([0] * B)
            elif first and any(t is not None and t.parents is not None for t in plan.text):
                plan = dataclasses.replace(plan, text=[None if t is not None and t.parents is not None else t
                                                       for t in plan.text])
            run = plan.plain and not first and (model is None or not model.drafts_every_round)
            if run:  # plain steps: no drafting, no selection; the drafter catches up after them
                drafter.skip()
                selected = time.perf_counter()
                outcome, keep = self._plain_steps(plan.steps)
                drafted = accepted = [0] * B
            else:
                if plan.plain and (waiting or model is None or not model.drafts_every_round):
                    proposal = self._plain(B)  # (the first round's: the prompt's forward)
                    if not waiting:
                        drafter.skip()
                else:
                    proposal = plan.select(drafter.propose(seqs, self.roots, plan))
                if proposal.draft_forwards:
                    for r, s in zip(self.active, seqs):
                        self.model_read[r] = len(s)
                selected = time.perf_counter()
                outcome = self.verify(proposal, prompt=first)
                if self.sampler.processors is not None:
                    self.sampler.processors.commit(outcome.tokens, outcome.num_accepted + 1, outcome.committed)
                drafted, accepted = outcome.drafted, outcome.accepted
            if not waiting:
                drafter.commit(outcome)
            now = time.perf_counter()
            sources = [Source.NONE] * B if run else proposal.source
            if not waiting:  # (the first round's seconds hold the prompt's forward: no round's cost)
                steps = outcome.tokens.shape[1] if run else 1
                controller.observe(
                    Report(plan, sources, drafted, accepted, outcome.committed, 1, (now - started) / steps,
                           (now - selected) / steps, steps=steps)
                    if run else
                    Report(plan, sources, drafted, accepted, outcome.committed, proposal.width, now - started,
                           now - selected, proposal.draft_seconds, proposal.draft_forwards, proposal.draft_steps,
                           proposal.warm, outcome.path, proposal.explores, timed=not first))
            if not run:
                keep = [i for i, r in enumerate(self.active)
                        if self.emit(r, outcome.committed[i], drafted[i], accepted[i], sources[i].name.lower())]
            if waiting and keep:  # each prompt's features, the context of the first new token (read at its first draft)
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                drafter.start([list(self.seqs[self.active[i]]) for i in keep], self.capacity, self.sampler,
                              self.generator, features=self.prompt_features[index])
            self._keep_rows(keep, drafter=not waiting)
            first = waiting = False
            self.prompt_features = None
        controller.finish()
        self.stats.draft_calls = drafter.calls
        return self.finish()
