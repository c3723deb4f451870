"""The drafter protocol: what every source of drafts gives the engine and what it is told back.

A drafter proposes, for every active row, a chain or a tree of tokens (:class:`Proposal`),
with the distribution each proposal was drawn from (None for deterministic proposals such
as copied text), as the round's plan (:class:`spec_ext.policies.RoundPlan`) says, and keeps
its own state (a KV cache, a text index) in step with what the target committed
(:class:`Outcome`). The engine verifies whatever shape comes back; it never asks which
drafter made it.

Also here, because drafters and engines both need them: :class:`Sampler` (temperature,
top-k, top-p), the chain loop (:func:`draft_chain`), the one tree grower (:func:`grow_tree`),
:func:`pad_rows`, :func:`feed_rows` and :func:`refeed_tree`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from spec_ext import ops
from spec_ext.models import check_model, check_pair
from spec_ext.ops import build_tree
from spec_ext.policies import RoundPlan, Source, TreeShape
from spec_ext.processing import Positions


@dataclass
class Proposal:
    """One round's drafts of every active row (B rows), a chain or a tree.

    Chain (``parents`` None): ``tokens`` [B,K] int64, draft j of row b at ``tokens[b, j]``,
    -1 past the row's drafts; ``q`` [B,K,V] float32, the distribution draft j was drawn
    from, or None (deterministic drafts: one-hot q).

    Tree: ``tokens`` [B,T] int64 with node 0 the root (the engine puts the row's last
    committed token there), -1 for absent nodes; ``parents`` [T] or [B,T], ``depth`` the
    same shape, ``mask`` [1|B,T,ceil(T/32)] int32 bits (:func:`spec_ext.ops.tree_mask`),
    ``max_depth`` on the host; ``q`` [B,T,V]: the distribution node i's children were drawn
    from, on the rows ``sampled_rows`` [B] bool (None: every row); other rows deterministic.

    ``num_draft`` [B] int64: drafts per row (a tree: its nodes but the root), on the device;
    the engine reads it with the round's one host sync. ``source``: per row, what drafted it
    (host; None: the model). ``explores``: a round drafted another way than the drafter's best
    only to measure it (a draft of another tokenizer trying its other mode): the policy does
    not learn from it. ``draft_seconds``, ``draft_forwards``, ``draft_steps``: the model's
    forwards this round (their seconds, count, and the drafts they computed: a chain's steps, a
    block's slots, a tree's depth); ``warm``: they cost what a round's drafting costs (not a
    catch-up over the prompt or skipped rounds).

    ``confidence`` [B,K] float32 for a chain, [B,T] for a tree (node 0, the root: 1): the
    drafter's probability of each draft given its prefix (q at the token when sampling; the
    softmax of the drafter's processed logits at the drafted token when greedy), 0 past the
    row's drafts; None for drafters without one (text drafts). Adaptive verification
    (:class:`spec_ext.policies.Adaptive`) trims by its cumulative products.
    """
    tokens: Tensor
    num_draft: Tensor
    q: Tensor | None = None
    parents: Tensor | None = None
    depth: Tensor | None = None
    mask: Tensor | None = None
    max_depth: int = 0
    sampled_rows: Tensor | None = None
    source: list[Source] | None = None
    explores: bool = False
    confidence: Tensor | None = None
    draft_seconds: float = 0.0
    draft_forwards: int = 0
    draft_steps: int = 0
    warm: bool = True

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def width(self) -> int:
        """Tokens verified per row, the root included."""
        return self.tokens.shape[1] + (0 if self.is_tree else 1)


@dataclass
class Outcome:
    """What the target committed of a :class:`Proposal`, for B rows.

    ``tokens`` [B,W] (device): the accepted drafts then one more token (corrected or bonus),
    -1 padded; ``num_accepted`` [B] (device) and ``accepted`` (host) the accepted counts;
    ``committed`` (host) each row's ``tokens[b, :accepted[b] + 1]``; ``last`` [B] the
    verified position (chain index or tree node) of the last accepted draft, or 0 (the
    root), whose target distribution gave the final token; ``path`` [B,W] the accepted node
    ids of a tree (None for a chain); ``p`` [B,W',V] the target distribution at each
    verified position (None when greedy); ``num_draft`` [B] the proposal's counts and
    ``drafted`` the same on the host; ``features`` [B,W',F] the target's hidden states of
    the drafter's ``target_layers`` at each verified position (None when it asks for none).
    """
    tokens: Tensor
    num_accepted: Tensor
    accepted: list[int]
    committed: list[list[int]]
    num_draft: Tensor
    drafted: list[int]
    last: Tensor
    path: Tensor | None = None
    p: Tensor | None = None
    features: Tensor | None = None


class Drafter:
    """A source of model drafts. Per generate call: :meth:`bind` and :meth:`start` once, then
    per round :meth:`propose` (or :meth:`skip`, a round it drafts nothing) and :meth:`commit`,
    and :meth:`keep_rows` when finished rows drop out.

    ``calls`` counts the drafter's model forwards; ``model`` is its draft causal LM (None:
    none, or not an HF causal LM); ``target_layers``: the target layers whose hidden states
    (HF's ``hidden_states[k]``) the drafter reads from every target forward (None: none),
    handed over in :meth:`start` and :class:`Outcome`; ``drafts_per_forward``: drafts one
    forward proposes (a block drafter's whole block); ``drafts_every_round``: a round where it
    drafts no row still runs its catch-up forward (MTP layers); ``reads_on_commit``: its
    :meth:`start` and :meth:`commit` read what was committed (a block drafter's context), so it
    is never behind the text; ``chain_length``: the chain
    it drafts where the policy names no length (a block's slots, the MTP layers; None: the
    policy's default).
    """

    calls: int = 0
    model = None
    drafts_per_forward: int = 1
    drafts_every_round: bool = False
    reads_on_commit: bool = False
    chain_length: int | None = None
    target_layers: tuple[int, ...] | None = None
    # what plans that read the bonus agreement need of the last round (see :meth:`bonus_agreement`):
    # all_accepted [B] bool, whether each row accepted every draft; bonus_p [B,V] the target's
    # distribution its last token came from (None when greedy); both None before the first round
    all_accepted: Tensor | None = None
    bonus_p: Tensor | None = None

    @property
    def proposer(self):
        """The module whose parameters drafting reads (policies price drafting by its size)."""
        return self.model

    @property
    def max_depth(self) -> int | None:
        """The most drafts it drafts in a line (a chain's length, a tree's depth; None: any)."""
        return None

    def bind(self, target) -> None:
        """Once per generate call, before :meth:`start`: check that the drafter fits ``target``
        (``ValueError`` naming what does not)."""
        if self.model is None:
            check_model(target, "target")
        else:
            check_pair(target, self.model)

    def start(self, seqs: list[list[int]], capacity: int, sampler: "Sampler", generator=None,
              features: Tensor | None = None) -> None:
        """Before the first round: every row's prompt (its last token is the first root),
        the most tokens a row may hold (prompt, output and one round's drafts), the sampler
        the target is verified with (drafts are drawn with it) and the generator; with
        ``target_layers``, ``features`` [B,L,F] of each prompt's tokens but its last (row b's
        first ``len(seqs[b]) - 1``; None when every prompt has one token)."""

    def propose(self, seqs: list[list[int]], roots: Tensor, plan: RoundPlan, forced: Tensor | None = None,
                forced_rows: Tensor | None = None) -> Proposal:
        """The drafts of every active row, as ``plan`` says (chains of ``plan.budget()``, or
        ``plan.tree``): ``seqs`` their committed tokens (host, read only), ``roots`` [B] the
        last committed token of each on the device. ``forced_rows`` [B] bool: rows whose drafts
        come from elsewhere (the text's), their tokens ``forced`` [B,k] (None: discarded); a
        drafter that keeps a draft cache feeds them, so it keeps what the target accepts there."""
        raise NotImplementedError

    def skip(self) -> None:
        """This round the drafter proposes nothing: it catches up over it in its next."""

    def commit(self, outcome: Outcome) -> None:
        """What the target kept of the last proposal: roll back what it rejected."""

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        """Only ``rows`` (indices into the current batch; ``index`` the same on the device) go on."""

    # ------------------------------------------------------------ bonus agreement
    def remember_bonus(self, outcome: Outcome) -> None:
        """After a round: which rows accepted every draft and the distribution their last
        token (the bonus) came from, for :meth:`bonus_agreement`."""
        self.all_accepted = outcome.num_accepted == outcome.num_draft
        rows = torch.arange(len(outcome.accepted), device=outcome.num_accepted.device)
        self.bonus_p = None if outcome.p is None else outcome.p[rows, outcome.last]

    def keep_bonus_rows(self, index: Tensor) -> None:
        """:meth:`remember_bonus`'s state of the rows ``index`` [B'] only."""
        if self.all_accepted is not None:
            self.all_accepted = self.all_accepted[index]
        if self.bonus_p is not None:
            self.bonus_p = self.bonus_p[index]

    def bonus_agreement(self, before: Tensor, bonus: Tensor, last: Tensor) -> Tensor:
        """[B] bool: rows whose last round accepted every draft and whose drafter, at the last
        draft's position, agrees with the bonus token (whether acceptance ran on unbroken through
        the root; :class:`spec_ext.policies.AdaLength` reads it). Of the drafter's catch-up over
        the tokens it had not seen, ``bonus`` [B] is each row's last (column ``last`` [B]) and
        ``before`` [B,V] the logits at the column before it (:func:`catch_up_columns`): what the
        drafter proposed for it. Greedy: its argmax is the bonus; sampling: a draw that agrees
        with chance sum_x min(p, q) (p: the bonus's distribution, q: the drafter's, processed by
        the sampler). A row whose catch-up holds the bonus alone (``last`` 0) has no such
        logits: its agreement counts as broken."""
        if self.all_accepted is None or not self.all_accepted.any():  # also the first round: no bonus yet
            return torch.zeros(len(bonus), dtype=torch.bool, device=bonus.device)
        if self.sampler.greedy:
            agreed = before.argmax(-1) == bonus
        else:
            chance = torch.minimum(self.bonus_p, self.sampler.probs(before)).sum(-1)
            agreed = torch.rand(chance.shape, device=chance.device, generator=self.generator) < chance
        return agreed & self.all_accepted & (last >= 1)


class Sampler:
    """How logits become a token, applied identically to p and q: the call's logits processors
    (``processors``, :class:`spec_ext.processing.Processors`, None when there are none:
    they read each position's prefix, so callers hand them the positions) and, when sampling,
    HF's warpers in HF's order: temperature, top-k, top-p, min-p, typical-p, epsilon and eta
    cutoffs (HF semantics, one token kept at least)."""

    def __init__(self, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 min_p: float | None = None, typical_p: float | None = None, epsilon_cutoff: float | None = None,
                 eta_cutoff: float | None = None, processors=None):
        if temperature is None or temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k: must be >= 1, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        if min_p is not None and not 0 <= min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {min_p}")
        if typical_p is not None and not 0 < typical_p <= 1:
            raise ValueError(f"typical_p: must be in (0, 1], got {typical_p}")
        for name, value in (("epsilon_cutoff", epsilon_cutoff), ("eta_cutoff", eta_cutoff)):
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name}: must be in [0, 1], got {value}")
        self.greedy = temperature == 0
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.min_p, self.typical_p, self.epsilon_cutoff, self.eta_cutoff = min_p, typical_p, epsilon_cutoff, eta_cutoff
        self.processors = processors if processors else None

    @property
    def settings(self) -> dict:
        """The warper settings (picklable: the parallel engine's draft side rebuilds the sampler from them)."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    typical_p=self.typical_p, epsilon_cutoff=self.epsilon_cutoff, eta_cutoff=self.eta_cutoff)

    def process(self, logits: Tensor, positions, check: bool = False) -> Tensor:
        """``logits`` [B,T,V] through the processors at ``positions`` (unchanged without any)."""
        return logits if self.processors is None else self.processors.apply(logits, positions, check)

    def probs(self, logits: Tensor) -> Tensor:
        x = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, index = torch.sort(x, dim=-1)
            tail = torch.softmax(ordered, -1).cumsum(-1) <= 1 - self.top_p
            tail[..., -1] = False
            x = x.masked_fill(tail.scatter(-1, index, tail), float("-inf"))
        if self.min_p is not None:
            p = torch.softmax(x, -1)
            x = x.masked_fill(p < self.min_p * p.amax(-1, keepdim=True), float("-inf"))
        if self.typical_p is not None and self.typical_p < 1:
            x = _typical(x, self.typical_p)
        for name, cutoff in (("epsilon", self.epsilon_cutoff), ("eta", self.eta_cutoff)):
            if cutoff is not None and 0 < cutoff < 1:
                p = torch.softmax(x, -1)
                if name == "eta":  # HF: min(eta, sqrt(eta) * exp(-entropy))
                    entropy = -(p * torch.log_softmax(x, -1)).nansum(-1, keepdim=True)
                    cutoff = torch.clamp_max(cutoff ** 0.5 * torch.exp(-entropy), cutoff)
                x = x.masked_fill((p < cutoff) & (x < x.amax(-1, keepdim=True)), float("-inf"))
        return torch.softmax(x, -1)

    def propose(self, logits: Tensor, generator=None) -> tuple[Tensor, Tensor | None]:
        """One token per row from logits [B,V] (greedy: the argmax) and the q [B,V] it was
        drawn from (None when greedy)."""
        if self.greedy:
            return logits.argmax(-1), None
        q = self.probs(logits)
        return torch.multinomial(q, 1, generator=generator).squeeze(1), q


def _typical(x: Tensor, mass: float) -> Tensor:
    """HF's typical-p: keep the tokens whose surprisal is closest to the entropy, up to ``mass``."""
    log_p = torch.log_softmax(x, -1)
    entropy = -(log_p.exp() * log_p).nansum(-1, keepdim=True)
    distance, order = torch.sort((-log_p - entropy).abs(), -1)
    cumulative = x.gather(-1, order).softmax(-1).cumsum(-1)
    last = (cumulative < mass).sum(-1, keepdim=True).clamp_max(x.shape[-1] - 1)
    drop = distance > distance.gather(-1, last)
    drop[..., 0] = False
    return x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def draft_chain(plan: RoundPlan, sampler: Sampler, generator, logits: Tensor, hidden: Tensor | None, step,
                budget: list[int], forced: Tensor | None = None, forced_rows: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The chain loop every drafter with distributions shares: from ``logits`` [B,V] (and the
    ``hidden`` [B,H] that produced them) propose a token per row, then ``step(token)`` gives
    the next logits and hidden, up to ``budget[b]`` drafts per row (a row of budget 0 drafts
    nothing), stopping rows where the plan's ``keep_drafting`` says (one host sync per step
    where the plan ``stops``).
    ``forced`` [B,k] replaces the drafts of ``forced_rows`` [B] bool (None: nothing is
    replaced). Returns drafts [B,K] (-1 padded), the q [B,K,V] each was drawn from (None
    when greedy), num_draft [B] and the confidence [B,K] float32 of each draft (q at the
    token; greedy: the softmax of the processed logits at it; 0 past a row's drafts)."""
    B, device = logits.shape[0], logits.device
    kmax = max(budget)
    budget_t = None if min(budget) == kmax else torch.tensor(budget, device=device)
    drafts = torch.full((B, kmax), -1, dtype=torch.int64, device=device)
    q_all = None if sampler.greedy else torch.zeros(B, kmax, logits.shape[-1], device=device)
    num_draft = torch.zeros(B, dtype=torch.int64, device=device)
    confidence = torch.zeros(B, kmax, device=device)
    going = torch.ones(B, dtype=torch.bool, device=device) if budget_t is None else budget_t > 0
    adaptive, steps = plan.stops, 0
    for n in range(1, kmax + 1):
        if sampler.processors is not None:
            logits = sampler.process(logits[:, None], Positions.after(drafts[:, :n - 1]))[:, 0]
        token, q = sampler.propose(logits, generator)
        if forced is not None:
            token = torch.where(forced_rows, forced[:, n - 1], token)
        drafts[:, n - 1] = torch.where(going, token, -1)
        probs = torch.softmax(logits.float(), -1) if q is None or adaptive else None
        chance = (probs if q is None else q).gather(1, token[:, None]).squeeze(1)
        confidence[:, n - 1] = torch.where(going, chance, 0.0)
        if q is not None:
            q_all[:, n - 1] = q
        num_draft += going
        steps = n
        if budget_t is not None:
            going = going & (n < budget_t)
        if adaptive:
            going &= plan.keep_drafting(n, probs, token, hidden)
        if n == kmax or (adaptive and not bool(going.any())):
            break
        logits, hidden = step(token)
    return drafts[:, :steps], None if q_all is None else q_all[:, :steps], num_draft, confidence[:, :steps]


def from_slots(plan: RoundPlan, logits: Tensor, read: Tensor | None, roots: Tensor, sampler: "Sampler", generator,
               budget: list[int] | None) -> Proposal:
    """Drafts from one forward's slots (a block drafter's, P-EAGLE's): ``logits`` [B,K,V], slot
    j the distribution of draft j + 1 whatever the drafts before it, and what each slot's output
    layer read [B,K,H] (None unless the plan reads hidden states). A chain of ``budget[b]``
    drafts (each slot processed after the drafts before it, drawn from its q), or the plan's
    tree grown by depth (a node at depth d: its children drawn from slot d)."""
    if plan.tree is not None:
        def refeed(tokens: Tensor, parents: Tensor, depth: Tensor, mask: Tensor) -> Tensor:
            at = depth.clamp_max(logits.shape[1] - 1)
            return logits.gather(1, at[..., None].expand(-1, -1, logits.shape[2]))
        return grow_tree(plan.tree, logits[:, 0], roots, refeed, sampler)
    slot = {"next": 0}

    def step(token: Tensor) -> tuple[Tensor, Tensor | None]:
        slot["next"] += 1
        return logits[:, slot["next"]], None if read is None else read[:, slot["next"]]

    drafts, q, num_draft, confidence = draft_chain(plan, sampler, generator, logits[:, 0],
                                                   None if read is None else read[:, 0], step, budget)
    return Proposal(drafts, num_draft, q, confidence=confidence)


def grow_tree(shape: TreeShape, logits: Tensor, roots: Tensor, refeed, sampler: Sampler | None = None) -> Proposal:
    """The tree ``shape`` of every row, grown from the root's drafter logits [B,V]:
    ``refeed(tokens [B,n], parents [B,n], depth [B,n], mask)`` gives the drafter's logits
    [B,n,V] at every node of the tree grown so far (node 0 the root); the ``sampler``'s
    processors, if any, act on them (each node's prefix its path). Deterministic drafts; each
    node's confidence is the softmax of its parent's processed logits at its token. A static
    shape grows the top-k of each level (:func:`_grow_static`), a dynamic one EAGLE-2's tree
    (:func:`_grow_dynamic`)."""
    grow = _grow_dynamic if shape.dynamic else _grow_static
    return grow(shape, logits, roots, refeed, sampler)


def _grow_static(policy: TreeShape, logits: Tensor, roots: Tensor, refeed, sampler: Sampler | None = None
                 ) -> Proposal:
    """The static tree (``branching[d]`` children per node at depth d), each level the top-k
    of the drafter's logits after its parent (see :func:`grow_tree`)."""
    B, device = logits.shape[0], logits.device
    parents, depth, mask, max_depth = _static_tree(tuple(policy.parents), device)
    levels, branching = policy.levels, policy.branching
    nodes = torch.zeros(B, len(policy.parents), dtype=torch.int64, device=device)
    confidence = torch.ones(B, len(policy.parents), device=device)
    nodes[:, 0] = roots
    root = _process_root(sampler, logits)
    nodes[:, levels[0]] = children = torch.topk(root, branching[0], dim=-1).indices
    confidence[:, levels[0]] = torch.softmax(root.float(), -1).gather(1, children)
    for d in range(1, len(levels)):
        n = levels[d - 1][-1] + 1  # the tree so far: nodes 0..n-1
        tree_logits = refeed(nodes[:, :n], parents[:, :n].expand(B, n), depth[:, :n].expand(B, n), mask[:, :n])
        tree_logits = _process_tree(sampler, tree_logits, nodes[:, :n], parents[:, :n], depth[:, :n], d)
        frontier = tree_logits[:, levels[d - 1]]
        children = torch.topk(frontier, branching[d], dim=-1).indices
        nodes[:, levels[d]] = children.reshape(B, -1)
        confidence[:, levels[d]] = torch.softmax(frontier.float(), -1).gather(2, children).reshape(B, -1)
    return Proposal(nodes, torch.full((B,), nodes.shape[1] - 1, device=device), None, parents[0], depth[0], mask,
                    max_depth, confidence=confidence)


def _process_root(sampler: Sampler | None, logits: Tensor) -> Tensor:
    """The root's logits [B,V] through the sampler's processors (a tree grows from them)."""
    if sampler is None or sampler.processors is None:
        return logits
    return sampler.process(logits[:, None], Positions.after(logits.new_zeros(len(logits), 0, dtype=torch.int64)))[:, 0]


def _process_tree(sampler: Sampler | None, logits: Tensor, tokens: Tensor, parents: Tensor, depth: Tensor,
                  max_depth: int) -> Tensor:
    """A tree's logits [B,n,V] through the sampler's processors, each node's prefix its path."""
    if sampler is None or sampler.processors is None:
        return logits
    return sampler.process(logits, Positions.tree(tokens, parents, depth, max_depth))


@functools.lru_cache(maxsize=32)
def _static_tree(parents: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor, int]:
    """parents [1,T], depth [1,T], mask [1,T,W] on ``device`` and the depth of a static tree,
    made once (building reads the tree on the host)."""
    tree = build_tree(list(parents))
    return tree.parents.to(device), tree.depth.to(device), tree.mask.to(device), tree.max_depth


def _grow_dynamic(policy: TreeShape, logits: Tensor, roots: Tensor, refeed, sampler: Sampler | None = None
                  ) -> Proposal:
    """EAGLE-2's tree (:class:`spec_ext.policies.DynamicTree`), grown per row on the device
    (no host sync) from the root's logits [B,V]. Each level the frontier's ``top_k`` children
    are scored by cumulative log-probability; all of them are candidates, the best ``top_k``
    become the next frontier. ``refeed(tokens [B,n], parents [B,n], depth [B,n], mask)``
    gives the drafter's logits [B,n,V] at every node of the expanded tree (node 0 the root).
    The best ``nodes`` candidates are kept (a stable sort: on a tie the earlier, so a node is
    never kept without its parent, which scores at least as much and comes first), in
    topological order, as deterministic drafts (the tree depends on no coin). Each node's
    confidence is the softmax of its parent's processed logits at its token."""
    B, device = logits.shape[0], logits.device
    k = min(policy.top_k, logits.shape[-1])
    rows = torch.arange(B, device=device)[:, None]
    logits = _process_root(sampler, logits)
    best = torch.log_softmax(logits.float(), -1).topk(k)
    first = torch.arange(1, k + 1, device=device).expand(B, k)
    root_parent = torch.full((B, 1), -1, device=device)
    # the expanded tree, re-fed each level: tokens, parents (positions in it), candidate ids
    tokens = torch.cat([roots[:, None], best.indices], 1)
    parents = torch.cat([root_parent, torch.zeros(B, k, dtype=torch.int64, device=device)], 1)
    expanded = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=device), first], 1)
    # every candidate: token, parent (candidate id), score
    cand_tokens, cand_parents = tokens, parents.clone()
    cand_scores = torch.cat([torch.zeros(B, 1, device=device), best.values], 1)
    for level in range(1, policy.depth):
        n, count = tokens.shape[1], cand_tokens.shape[1]
        frontier = torch.arange(n - k, n, device=device).expand(B, k)
        depth, mask = ops.tree_mask(parents, validate=False)
        tree_logits = _process_tree(sampler, refeed(tokens, parents, depth, mask), tokens, parents, depth, level)
        logp = torch.log_softmax(tree_logits[rows, frontier].float(), -1)
        children = logp.topk(k)  # [B, k frontier nodes, k children]
        total = (cand_scores.gather(1, expanded[:, n - k:])[..., None] + children.values).view(B, k * k)
        cand_tokens = torch.cat([cand_tokens, children.indices.view(B, -1)], 1)
        cand_parents = torch.cat([cand_parents, expanded[:, n - k:].repeat_interleave(k, 1)], 1)
        cand_scores = torch.cat([cand_scores, total], 1)
        chosen = total.topk(k).indices
        tokens = torch.cat([tokens, children.indices.view(B, -1).gather(1, chosen)], 1)
        parents = torch.cat([parents, frontier.gather(1, chosen // k)], 1)
        expanded = torch.cat([expanded, count + chosen], 1)
    T = min(policy.nodes, cand_tokens.shape[1])
    order = torch.sort(cand_scores[:, 1:], dim=1, descending=True, stable=True).indices[:, :T - 1] + 1
    kept = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=device), order.sort(1).values], 1)
    renumber = torch.full_like(cand_parents, -1).scatter_(1, kept, torch.arange(T, device=device).expand(B, T))
    kept_parents = renumber.gather(1, cand_parents.gather(1, kept).clamp_min(0))
    kept_parents[:, 0] = -1
    depth, mask = ops.tree_mask(kept_parents, validate=False)
    kept_scores = cand_scores.gather(1, kept)
    confidence = (kept_scores - kept_scores.gather(1, kept_parents.clamp_min(0))).exp()
    confidence[:, 0] = 1.0
    return Proposal(cand_tokens.gather(1, kept), torch.full((B,), T - 1, device=device), None, kept_parents, depth,
                    mask, policy.depth, confidence=confidence)


def pad_rows(rows: Sequence[Sequence[int]], value: int, device, left: bool = False, width: int = 0) -> Tensor:
    """[B, max(longest, width)] int64: ragged rows padded with ``value`` on the right (or the left)."""
    width = max(width, max(len(r) for r in rows))
    padded = [[value] * (width - len(r)) + list(r) if left else list(r) + [value] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device)


def catch_up_columns(last: Tensor, agreement: bool, slots: int = 1) -> Tensor:
    """[B,n] int64: the columns of a catch-up whose logits a drafter reads, from each row's
    last (``last`` [B]): the column before it where it reads the bonus agreement
    (:meth:`Drafter.bonus_agreement`), then the last and the ``slots - 1`` after it."""
    columns = last[:, None] + torch.arange(slots, device=last.device)
    return torch.cat([(last - 1).clamp_min(0)[:, None], columns], 1) if agreement else columns


def feed_rows(cache, ids: Tensor, lengths: Sequence[int], run, lengths_t: Tensor | None = None):
    """``run(ids, positions)`` over ``ids`` [B,T] int64 written after each row's cached
    tokens, of which ``cache`` keeps row b's first ``lengths[b]`` (``lengths_t`` [B]: the same
    on the device, when the caller has them). Every row writes the padded width from its own
    length (rows' pending tokens may differ by more than one round's drafts, which the
    capacity was sized for): the cache grows to fit. Returns run's output and each row's last
    kept column [B] int64."""
    cache.reserve(max(cache.host_lengths) + ids.shape[1])
    out = run(ids, cache.lengths[:, None] + torch.arange(ids.shape[1], device=ids.device))
    lengths_t = torch.tensor(list(lengths), device=ids.device) if lengths_t is None else lengths_t
    cache.advance(lengths, lengths_t)
    return out, lengths_t - 1


def refeed_tree(cache, run, ids: Tensor, depth: Tensor, mask: Tensor):
    """``run(ids, positions, mask)`` over a tree's nodes ``ids`` [B,n] (``depth`` [B,n])
    after each row's committed tokens, node 0 (the last committed token, the root) at its own
    position again; the cache keeps the committed tokens. Returns run's output."""
    cache.rollback([x - 1 for x in cache.host_lengths])
    cache.reserve(max(cache.host_lengths) + ids.shape[1])
    out = run(ids, cache.lengths[:, None] + depth, mask)
    cache.advance([1] * len(ids))
    return out


def check_finite(logits: Tensor, model: str) -> None:
    """Raise unless ``logits`` (of ``model``, on the prompt) are all finite. The loops check
    each model once per call, at the prompt's last token (a NaN or inf reaches it from any
    position before), and verify the rounds unchecked: NaN or inf
    logits (broken weights, float16 overflow) would otherwise decode into garbage."""
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"{model}: its logits on the prompt contain NaN or inf (check its weights and dtype)")
