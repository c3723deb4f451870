"""The serial engine: the drafter-verifier loop on Hugging Face models, for ragged batches.

Each round, for every unfinished row at once: the draft proposes a chain (or a tree),
the target verifies it in one forward through :class:`SpecCache` and tree attention, a
rejection sampler keeps what the target's distribution allows, and both caches roll back
to what was kept. One host sync per round (the accepted counts), plus one per draft step
for adaptive policies that decide on the host when to stop drafting.

Cache convention: the target cache holds every committed token but the last, which is
the root of the next verification; the draft cache holds a prefix of the committed
tokens and catches up (``pending``) at the start of its next round.
"""
from __future__ import annotations

import torch
from torch import Tensor

from spec_ext import ops
from spec_ext.engine.common import Rows, Stats, check_finite, pad_rows, prefill
from spec_ext.models import SpecCache, forward
from spec_ext.ops import build_tree
from spec_ext.policies import NGram, Policy, Tree


class SerialEngine(Rows):
    """Runs one generate call's rounds with a chain rule, a :class:`Tree` policy or
    :class:`NGram` (drafts from the text; the draft model, if any, drafts the rows the text
    has no match for)."""

    def __init__(self, target, draft, prompts, max_new_tokens, sampler, eos, policy: Policy, generator, streamer):
        super().__init__(prompts, max_new_tokens, eos, streamer)
        self.target, self.draft = target, draft
        self.sampler, self.policy, self.generator = sampler, policy, generator
        self.device = target.device
        capacity = max(len(p) for p in prompts) + max_new_tokens + policy.max_draft + 2
        self.tcache = SpecCache.for_model(target, len(prompts), capacity)
        self.dcache = None if draft is None else SpecCache.for_model(draft, len(prompts), capacity)
        self.lookup = isinstance(policy, NGram)
        self.matched = [False] * len(prompts)  # per current row: did its last round draft from the text
        self.draft_hidden = policy.uses_draft_hidden
        self.target_hidden = policy.uses_target_hidden
        self.bonus_agreement = policy.uses_bonus_agreement
        # per row: did the last round accept every draft, and the distribution p its bonus came from
        self.all_accepted = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        self.bonus_p: Tensor | None = None
        # a policy that never stops a row early needs no host sync per draft step
        self.adaptive = policy.adaptive
        self._carry: dict | None = None  # what the next round needs from the last one, on the device
        if isinstance(policy, Tree):
            self.tree = build_tree(policy.parents)
            self.parents = self.tree.parents.to(self.device)
            self.tree_mask = self.tree.mask.to(self.device)
            self.depth = self.tree.depth[0].to(self.device)
            self.max_depth = self.tree.max_depth

    # ------------------------------------------------------------------ forwards
    def _target(self, ids: Tensor, positions: Tensor, mask=None, hidden=False):
        self.stats.target_calls += 1
        return forward(self.target, ids, self.tcache, positions, mask, hidden)

    def _draft(self, ids: Tensor, positions: Tensor, mask=None, hidden=False):
        self.stats.draft_calls += 1
        return forward(self.draft, ids, self.dcache, positions, mask, hidden)

    def prefill(self) -> None:
        heads = [s[:-1] for s in self.seqs]
        out = prefill(self.target, self.tcache, heads, "target", hidden=self.target_hidden)
        if out is None:
            return
        self.stats.target_calls += 1
        if self.target_hidden and min(map(len, heads)) > 0:  # one-token prompts: the policy's first guess
            last = torch.tensor([len(h) - 1 for h in heads], device=self.device)
            rows = torch.arange(len(heads), device=self.device)
            roots = torch.tensor([s[-1] for s in self.seqs], device=self.device)
            self.policy.see_target(out[1][rows, last], roots)

    def _catch_up_draft(self, carry: dict | None) -> tuple[Tensor, Tensor | None]:
        """Feed the draft the committed tokens it has not seen (``carry``: those of the last
        round, on the device; None: from the host lists); logits [B,V] after the last (and
        the hidden state [B,H] that produced them, for policies that need it)."""
        if carry is None:
            pending = [self.seqs[r][n:] for r, n in zip(self.active, self.dcache.host_lengths)]
            ids, lengths = pad_rows(pending, 0, self.device), [len(p) for p in pending]
            last = torch.tensor([n - 1 for n in lengths], device=self.device)
        else:
            ids, lengths, last = carry["ids"], carry["lengths"], carry["last"]
        positions = self.dcache.lengths[:, None] + torch.arange(ids.shape[1], device=self.device)
        out = self._draft(ids, positions, hidden=self.draft_hidden)
        if self.stats.draft_calls == 1:  # the prompt
            check_finite(out[0] if self.draft_hidden else out, "draft")
        rows = torch.arange(len(lengths), device=self.device)
        self.dcache.advance(lengths, last + 1)
        if self.bonus_agreement:
            self.policy.see_bonus_agreement(self._bonus_agreement(out[0] if self.draft_hidden else out, ids, last))
        if self.draft_hidden:
            return out[0][rows, last], out[1][rows, last]
        return out[rows, last], None

    def _carry_over(self, tokens: Tensor, first: Tensor, num_accepted: Tensor, first_host: list[int],
                    accepted: list[int]) -> None:
        """Keep on the device what the next round needs from this one: the tokens the draft
        has not seen, ``tokens[b, first[b] .. num_accepted[b]]`` (tokens [B,K+1], -1 padded),
        and the next root ``tokens[b, num_accepted[b]]``; the host knows the lengths already."""
        lengths = [a - f + 1 for f, a in zip(first_host, accepted)]
        index = (first[:, None] + torch.arange(max(lengths), device=self.device)).clamp_max(tokens.shape[1] - 1)
        self._carry = dict(ids=tokens.gather(1, index).clamp_min(0), lengths=lengths, last=num_accepted - first,
                           roots=tokens.gather(1, num_accepted[:, None]).squeeze(1))

    def _bonus_agreement(self, logits: Tensor, ids: Tensor, last: Tensor) -> Tensor:
        """[B] bool: rows whose last round accepted every draft and whose draft, at the last
        draft's position (logits [B,T,V] of the catch-up over ids [B,T]), agrees with the
        bonus token (ids[b, last[b]]); see :meth:`Policy.see_bonus_agreement`."""
        if not self.all_accepted.any():  # also the first round: no bonus yet
            return self.all_accepted.clone()
        rows = torch.arange(len(ids), device=self.device)
        before = logits[rows, (last - 1).clamp_min(0)]
        if self.sampler.greedy:
            agreed = before.argmax(-1) == ids[rows, last]
        else:
            chance = torch.minimum(self.bonus_p, self.sampler.probs(before)).sum(-1)
            agreed = torch.rand(chance.shape, device=self.device, generator=self.generator) < chance
        # a row that drafted less than the batch fed its last draft while drafting (the
        # catch-up has only its bonus): its agreement is not known and counts as broken
        return agreed & self.all_accepted & (last >= 1)

    def _propose(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.sampler.greedy:
            return logits.argmax(-1), None
        q = self.sampler.probs(logits)
        return torch.multinomial(q, 1, generator=self.generator).squeeze(1), q

    # ------------------------------------------------------------------ rounds
    def chain_round(self) -> tuple[list[list[int]], list[int], list[int]]:
        B = len(self.active)
        carry, self._carry = self._carry, None
        logits, hidden = self._catch_up_draft(carry)
        start, start_t = list(self.dcache.host_lengths), self.dcache.lengths
        budget = self.policy.plan()
        kmax = max(budget)
        budget_t = None if min(budget) == kmax else torch.tensor(budget, device=self.device)
        drafts = torch.full((B, kmax), -1, dtype=torch.int64, device=self.device)
        q_all = None if self.sampler.greedy else torch.zeros(B, kmax, logits.shape[-1], device=self.device)
        num_draft = torch.zeros(B, dtype=torch.int64, device=self.device)
        going = torch.ones(B, dtype=torch.bool, device=self.device)
        extra_forwards, steps = 0, 0
        for step in range(1, kmax + 1):
            token, q = self._propose(logits)
            drafts[:, step - 1] = torch.where(going, token, -1)
            if q is not None:
                q_all[:, step - 1] = q
            num_draft += going
            steps = step
            if budget_t is not None:
                going = going & (step < budget_t)
            if self.adaptive:
                going &= self.policy.keep_drafting(step, torch.softmax(logits, -1), token, hidden)
            if step == kmax or (self.adaptive and not bool(going.any())):
                break
            out = self._draft(token[:, None], self.dcache.lengths[:, None], hidden=self.draft_hidden)
            logits, hidden = (out[0][:, 0], out[1][:, 0]) if self.draft_hidden else (out[:, 0], None)
            self.dcache.advance([1] * B)
            extra_forwards += 1
        drafts = drafts[:, :steps]
        roots = self._roots(carry)
        ids = torch.cat([roots[:, None], drafts.clamp_min(0)], 1)
        positions = self.tcache.lengths[:, None] + torch.arange(steps + 1, device=self.device)
        target_out = self._target(ids, positions, hidden=self.target_hidden)
        target_logits = target_out[0] if self.target_hidden else target_out
        # the loop builds the verification's inputs itself: no input checks (they cost 2.7% of
        # a greedy call at batch 1 on CPU); the models' logits were checked on the prompt
        if self.sampler.greedy:
            p, result = None, ops.greedy_verify(target_logits, drafts, num_draft, validate=False)
        else:
            p = self.sampler.probs(target_logits)
            result = ops.chain_rejection_sample(p, drafts, q_all[:, :steps], num_draft, generator=self.generator,
                                                validate=False)
        rows = torch.arange(B, device=self.device) if self.bonus_agreement or self.target_hidden else None
        if self.bonus_agreement:
            self.all_accepted = result.num_accepted == num_draft
            self.bonus_p = None if p is None else p[rows, result.num_accepted]
        if self.target_hidden:
            self.policy.see_target(target_out[1][rows, result.num_accepted], result.tokens[rows, result.num_accepted])
        # the round's one host sync: what was emitted (EOS, streaming, max_new_tokens)
        outcome = torch.cat([result.tokens, result.num_accepted[:, None], num_draft[:, None]], 1).tolist()
        tokens, accepted, drafted = [o[:-2] for o in outcome], [o[-2] for o in outcome], [o[-1] for o in outcome]
        fed = [min(a, extra_forwards) for a in accepted]  # accepted drafts the draft has seen already
        fed_t = result.num_accepted.clamp_max(extra_forwards)
        self.tcache.advance([a + 1 for a in accepted], result.num_accepted + 1)
        self.dcache.rollback([s + f for s, f in zip(start, fed)], start_t + fed_t)
        self._carry_over(result.tokens, fed_t, result.num_accepted, fed, accepted)
        return tokens, accepted, drafted

    def tree_round(self) -> tuple[list[list[int]], list[int], list[int]]:
        B = len(self.active)
        carry, self._carry = self._carry, None
        logits, _ = self._catch_up_draft(carry)
        levels, branching = self.policy.levels, self.policy.branching
        T = len(self.policy.parents)
        nodes = torch.zeros(B, T, dtype=torch.int64, device=self.device)
        nodes[:, 0] = self._roots(carry)
        nodes[:, levels[0]] = torch.topk(logits, branching[0], dim=-1).indices
        for d in range(1, len(levels)):
            n = levels[d - 1][-1] + 1  # the tree so far: nodes 0..n-1, root re-fed at its own position
            self.dcache.rollback([x - 1 for x in self.dcache.host_lengths])
            tree_logits = self._draft(nodes[:, :n], self.dcache.lengths[:, None] + self.depth[:n],
                                      self.tree_mask[:, :n])
            self.dcache.advance([1] * B)
            children = torch.topk(tree_logits[:, levels[d - 1]], branching[d], dim=-1).indices
            nodes[:, levels[d]] = children.reshape(B, -1)
        target_logits = self._target(nodes, self.tcache.lengths[:, None] + self.depth, self.tree_mask)
        drafts = nodes
        if self.sampler.greedy:
            result = ops.tree_greedy_verify(target_logits, drafts, self.parents, max_depth=self.max_depth,
                                            validate=False)
        else:
            result = ops.tree_rejection_sample(self.sampler.probs(target_logits), drafts, self.parents,
                                               generator=self.generator, max_depth=self.max_depth,
                                               validate=False)
        outcome = torch.cat([result.tokens, result.num_accepted[:, None]], 1).tolist()  # the round's host sync
        tokens, accepted = [o[:-1] for o in outcome], [o[-1] for o in outcome]
        self.tcache.commit(result.path, accepted, result.num_accepted)
        # the draft's cache holds the committed tokens up to the root: it has seen none of the path
        self._carry_over(result.tokens, torch.zeros_like(result.num_accepted), result.num_accepted, [0] * B,
                         accepted)
        return tokens, accepted, [T - 1] * B

    # ------------------------------------------------------------------ prompt lookup (NGram)
    def _roots(self, carry: dict | None) -> Tensor:
        if carry is not None:
            return carry["roots"]
        return torch.tensor([self.seqs[r][-1] for r in self.active], device=self.device)

    def lookup_chain_round(self) -> tuple[list[list[int]], list[int], list[int]]:
        """Each row drafts the chain the text proposes; with a draft model, the rows without a
        match take ``draft_k`` drafts of the draft model, whose steps are fed the text's
        drafts on the other rows (so its cache keeps what the target accepts there too)."""
        B = len(self.active)
        carry, self._carry = self._carry, None
        chains = self.policy.chains()
        self.matched = [bool(c) for c in chains]
        use_draft = self.draft is not None and not all(self.matched)
        draft_k = self.policy.draft_k if use_draft else 0
        K = max(draft_k, max(map(len, chains)))
        lookup = torch.tensor([c + [-1] * (K - len(c)) for c in chains], dtype=torch.int64,
                              device=self.device).view(B, K)
        num_draft_host = [len(c) if c else draft_k for c in chains]
        num_draft = torch.tensor(num_draft_host, device=self.device)
        drafts, q_all, extra_forwards = lookup.clone(), None, 0
        if use_draft:
            logits, _ = self._catch_up_draft(carry)
            start, start_t = list(self.dcache.host_lengths), self.dcache.lengths
            from_text = torch.tensor(self.matched, device=self.device)
            if not self.sampler.greedy:
                q_all = torch.zeros(B, K, logits.shape[-1], device=self.device)
            for step in range(1, draft_k + 1):
                token, q = self._propose(logits)
                token = torch.where(from_text, lookup[:, step - 1], token)
                drafts[:, step - 1] = token
                if q is not None:
                    q_all[:, step - 1] = q
                if step == draft_k:
                    break
                logits = self._draft(token.clamp_min(0)[:, None], self.dcache.lengths[:, None])[:, 0]
                self.dcache.advance([1] * B)
                extra_forwards += 1
            if q_all is not None:  # the text's drafts are deterministic: one-hot q
                one_hot = torch.zeros_like(q_all).scatter_(2, lookup.clamp_min(0)[..., None], 1.0)
                q_all = torch.where(from_text[:, None, None], one_hot, q_all)
        ids = torch.cat([self._roots(carry)[:, None], drafts.clamp_min(0)], 1)
        positions = self.tcache.lengths[:, None] + torch.arange(K + 1, device=self.device)
        target_logits = self._target(ids, positions)
        if self.sampler.greedy:
            result = ops.greedy_verify(target_logits, drafts, num_draft, validate=False)
        else:
            result = ops.chain_rejection_sample(self.sampler.probs(target_logits), drafts, q_all, num_draft,
                                                generator=self.generator, validate=False)
        outcome = torch.cat([result.tokens, result.num_accepted[:, None]], 1).tolist()  # the round's host sync
        tokens, accepted = [o[:-1] for o in outcome], [o[-1] for o in outcome]
        self.tcache.advance([a + 1 for a in accepted], result.num_accepted + 1)
        if use_draft:
            fed = [min(a, extra_forwards) for a in accepted]
            fed_t = result.num_accepted.clamp_max(extra_forwards)
            self.dcache.rollback([s + f for s, f in zip(start, fed)], start_t + fed_t)
            self._carry_over(result.tokens, fed_t, result.num_accepted, fed, accepted)
        return tokens, accepted, num_draft_host

    def lookup_tree_round(self) -> tuple[list[list[int]], list[int], list[int]]:
        """Each row verifies its own tree of the text's continuations (per-row parents and
        tree masks, -1 padded nodes that are always rejected); with a draft model, the rows
        without a match verify a chain of ``draft_k`` drafts of the draft model instead."""
        B = len(self.active)
        carry, self._carry = self._carry, None
        trees = self.policy.trees()
        self.matched = [len(tokens) > 1 for tokens, _ in trees]
        use_draft = self.draft is not None and not all(self.matched)
        draft_k = self.policy.draft_k if use_draft else 0
        T = max(draft_k + 1, max(len(tokens) for tokens, _ in trees))
        rows, parent_rows, drafted, max_depth = [], [], [], 0
        for (tokens, parents), from_text in zip(trees, self.matched):
            if use_draft and not from_text:  # a chain for the draft model to fill
                tokens, parents = [-1] * (draft_k + 1), [-1] + list(range(draft_k))
            depth = [0]
            for p in parents[1:]:
                depth.append(depth[p] + 1)
            max_depth = max(max_depth, max(depth))
            drafted.append(len(tokens) - 1)
            rows.append(tokens + [-1] * (T - len(tokens)))
            parent_rows.append(parents + [0] * (T - len(parents)))
        nodes = torch.tensor(rows, dtype=torch.int64, device=self.device)
        parents = torch.tensor(parent_rows, dtype=torch.int64, device=self.device)
        depth, mask = ops.tree_mask(parents, validate=False)
        q_chain, extra_forwards = None, 0
        if use_draft:
            logits, _ = self._catch_up_draft(carry)
            start, start_t = list(self.dcache.host_lengths), self.dcache.lengths
            by_draft = ~torch.tensor(self.matched, device=self.device)
            if not self.sampler.greedy:
                q_chain = torch.zeros(B, draft_k, logits.shape[-1], device=self.device)
            for step in range(1, draft_k + 1):
                token, q = self._propose(logits)
                nodes[:, step] = torch.where(by_draft, token, nodes[:, step])
                if q is not None:
                    q_chain[:, step - 1] = q
                if step == draft_k:
                    break
                logits = self._draft(token[:, None], self.dcache.lengths[:, None])[:, 0]
                self.dcache.advance([1] * B)
                extra_forwards += 1
        nodes[:, 0] = self._roots(carry)
        target_logits = self._target(nodes.clamp_min(0), self.tcache.lengths[:, None] + depth, mask)
        if self.sampler.greedy:
            result = ops.tree_greedy_verify(target_logits, nodes, parents, max_depth=max_depth, validate=False)
        else:
            result = self._sample_trees(self.sampler.probs(target_logits), nodes, parents, q_chain, max_depth)
        outcome = torch.cat([result.tokens, result.num_accepted[:, None]], 1).tolist()  # the round's host sync
        tokens, accepted = [o[:-1] for o in outcome], [o[-1] for o in outcome]
        self.tcache.commit(result.path, accepted, result.num_accepted)
        if use_draft:  # the draft keeps the accepted drafts of its own rows; it was fed no text rows' tree
            fed = [0 if m else min(a, extra_forwards) for a, m in zip(accepted, self.matched)]
            fed_t = torch.where(by_draft, result.num_accepted.clamp_max(extra_forwards), 0)
            self.dcache.rollback([s + f for s, f in zip(start, fed)], start_t + fed_t)
            self._carry_over(result.tokens, fed_t, result.num_accepted, fed, accepted)
        return tokens, accepted, drafted

    def _sample_trees(self, p: Tensor, nodes: Tensor, parents: Tensor, q_chain: Tensor | None, max_depth: int):
        """Rejection sampling of a lookup tree round: the text's trees with one-hot q (siblings
        without replacement); the draft model's chains (rows where ``q_chain`` [B,k,V] is
        used) by the chain sampler with the q they were drawn from."""
        if q_chain is None:
            return ops.tree_rejection_sample(p, nodes, parents, generator=self.generator, max_depth=max_depth,
                                             validate=False)
        B, width, k = nodes.shape[0], max_depth + 1, q_chain.shape[1]
        text = torch.tensor(self.matched, device=self.device)
        path = torch.full((B, width), -1, dtype=torch.int64, device=self.device)
        tokens = torch.full((B, width), -1, dtype=torch.int64, device=self.device)
        num_accepted = torch.zeros(B, dtype=torch.int64, device=self.device)
        rows = text.nonzero().squeeze(1), (~text).nonzero().squeeze(1)
        if len(rows[0]):
            r = rows[0]
            tree = ops.tree_rejection_sample(p[r], nodes[r], parents[r], generator=self.generator,
                                             max_depth=max_depth, validate=False)
            path[r], tokens[r], num_accepted[r] = tree.path, tree.tokens, tree.num_accepted
        r = rows[1]
        chain = ops.chain_rejection_sample(p[r, :k + 1], nodes[r, 1:k + 1], q_chain[r], generator=self.generator,
                                           validate=False)
        steps = torch.arange(k + 1, device=self.device)
        path[r, :k + 1] = torch.where(steps <= chain.num_accepted[:, None], steps, -1)
        tokens[r, :k + 1], num_accepted[r] = chain.tokens, chain.num_accepted
        return ops.TreeResult(path, tokens, num_accepted)

    # ------------------------------------------------------------------ bookkeeping
    def run(self) -> Stats:
        self.policy.start(len(self.active), self.sampler.greedy)
        if self.lookup:
            self.policy.reset(self.seqs)
        self.prefill()
        if isinstance(self.policy, Tree):
            round_fn = self.tree_round
        elif self.lookup:
            round_fn = self.lookup_tree_round if self.policy.tree else self.lookup_chain_round
        else:
            round_fn = self.chain_round
        while self.active:
            tokens, accepted, drafted = round_fn()
            self.policy.observe(drafted, accepted)
            if self.lookup:
                self.policy.extend([t[:a + 1] for t, a in zip(tokens, accepted)])
            keep = []
            for i, r in enumerate(self.active):
                if self.emit(r, tokens[i][:accepted[i] + 1], drafted[i], accepted[i], self.matched[i]):
                    keep.append(i)
            if len(keep) < len(self.active):
                self.tcache.keep_rows(keep)
                if self.dcache is not None:
                    self.dcache.keep_rows(keep)
                self.policy.keep_rows(keep)
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                if self._carry is not None:  # None after a round that left the draft out
                    self._carry = {k: [v[i] for i in keep] if k == "lengths" else v[index]
                                   for k, v in self._carry.items()}
                if self.bonus_agreement:
                    self._keep_round_outcome(index)
                self.active = [self.active[i] for i in keep]
        return self.finish()

    def _keep_round_outcome(self, index: Tensor) -> None:
        self.all_accepted = self.all_accepted[index]
        if self.bonus_p is not None:
            self.bonus_p = self.bonus_p[index]
