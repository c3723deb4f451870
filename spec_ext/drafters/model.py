"""A draft model: a transformers causal LM with the target's tokenizer drafts a chain (as
long as the round's plan says) or a tree (a static top-k one, EAGLE-2's dynamic one)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler, catch_up_columns, check_finite, draft_chain, \
    feed_rows, grow_tree, pad_rows, refeed_tree
from spec_ext.drafters.kinds import DraftKind, register_kind
from spec_ext.models import Forward, SpecCache, forward
from spec_ext.policies import RoundPlan


class ModelDrafter(Drafter):
    """Drafts with ``model`` over its own :class:`SpecCache` (``hidden``: its forwards also
    return the last hidden state, for plans that read it).

    Cache convention: the draft's cache holds a prefix of the committed tokens; what it has
    not seen (the last round's accepted drafts it was not fed, the corrected or bonus token)
    waits on the device (the carry) and is fed at the start of the next round, whose last
    logits propose the first draft. One forward per further draft step (a chain) or per
    tree level (a tree: the tree so far, re-fed with tree attention).

    Example:
        >>> spec_ext.generate(target, ModelDrafter(draft), ids, policy=Fixed(4)).stats.draft_calls  # doctest: +SKIP
    """

    def __init__(self, model, hidden: bool = False):
        self.model = model
        self.hidden = hidden

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        self.sampler, self.generator, self.calls = sampler, generator, 0
        self.device = self.model.device
        self.cache = SpecCache.for_model(self.model, len(seqs), capacity)
        self._carry: dict | None = None
        # (drafts fed to every row past the committed ones, the rows [B] bool whose drafts the target
        # verifies and the same on the host, None: all): commit keeps what the target accepts
        self._fed: tuple | None = None
        self.all_accepted = self.bonus_p = None

    def prefill(self, rows: list[list[int]]) -> None:
        """Feed ``rows`` (ragged, from position 0) to the draft's cache in one forward: the
        parallel engine's lanes start so; the serial rounds feed the prompt as a catch-up."""
        if max(map(len, rows)):
            lengths = [len(r) for r in rows]
            last = torch.tensor([max(n - 1, 0) for n in lengths], device=self.device)[:, None]
            out, _ = feed_rows(self.cache, pad_rows(rows, 0, self.device), lengths,
                               lambda ids, positions: self.forward(ids, positions, logits_at=last))
            check_finite(out.logits, "draft")  # (at each row's last token: a NaN reaches it from any before)

    def forward(self, ids: Tensor, positions: Tensor, mask: Tensor | None = None,
                logits_at: Tensor | None = None) -> Forward:
        """The draft's logits [B,T,V] (at ``logits_at`` [B,n] alone: [B,n,V]) and, with
        ``hidden``, hidden states [B,T,H]."""
        self.calls += 1
        return forward(self.model, ids, self.cache, positions, mask, self.hidden, logits_at=logits_at)

    def propose(self, seqs: list[list[int]], roots: Tensor, plan: RoundPlan, forced: Tensor | None = None,
                forced_rows: Tensor | None = None) -> Proposal:
        logits, hidden, agreement = self._catch_up(seqs, plan.reads_agreement)
        if plan.tree is not None:
            proposal = grow_tree(plan.tree, logits, roots, lambda tokens, parents, depth, mask: refeed_tree(
                self.cache, self.forward, tokens, depth, mask).logits, self.sampler)
            self._fed = 0, None, None  # the cache holds the committed tokens up to the root: none of the tree
            return proposal
        B = len(seqs)

        def step(token: Tensor) -> tuple[Tensor, Tensor | None]:
            out = self.forward(token.clamp_min(0)[:, None], self.cache.lengths[:, None])
            self.cache.advance([1] * B)
            return out.logits[:, 0], None if out.hidden is None else out.hidden[:, 0]

        drafts, q, num_draft, confidence = draft_chain(plan, self.sampler, self.generator, logits, hidden, step,
                                                       plan.budget(agreement), forced, forced_rows)
        if forced_rows is not None and forced is None:  # the rows' drafts are discarded: only the others' kept
            self._fed = drafts.shape[1] - 1, ~forced_rows, (~forced_rows).tolist()
        else:
            self._fed = drafts.shape[1] - 1, None, None
        return Proposal(drafts, num_draft, q, confidence=confidence)

    # ------------------------------------------------------------------ state
    def skip(self) -> None:
        self._carry, self._fed = None, None

    def commit(self, outcome: Outcome) -> None:
        self.remember_bonus(outcome)
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

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.cache.keep_rows(rows)
        if self._carry is not None:
            self._carry = {k: [v[i] for i in rows] if k == "lengths" else v[index] for k, v in self._carry.items()}
        self.keep_bonus_rows(index)

    def _catch_up(self, seqs: list[list[int]], agreement: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Feed the draft the committed tokens it has not seen (the carry, on the device; the
        first round or after a skip: from the host lists); logits [B,V] after the last, the
        hidden state [B,H] that produced them (with ``hidden``) and, where asked, the rows'
        bonus agreement [B] bool."""
        carry, self._carry = self._carry, None
        if carry is None:
            pending = [s[n:] for s, n in zip(seqs, self.cache.host_lengths)]
            lengths = [len(p) for p in pending]
            ids, lengths_t = pad_rows(pending, 0, self.device), torch.tensor(lengths, device=self.device)
        else:
            ids, lengths, lengths_t = carry["ids"], carry["lengths"], carry["last"] + 1
        last = lengths_t - 1
        at = catch_up_columns(last, agreement)  # (an LM head over a prompt's every token costs more than the rest)
        out, _ = feed_rows(self.cache, ids, lengths, lambda i, p: self.forward(i, p, logits_at=at), lengths_t)
        if self.calls == 1:  # the prompt
            check_finite(out.logits, "draft")
        rows = torch.arange(len(lengths), device=self.device)
        agreed = self.bonus_agreement(out.logits[:, 0], ids[rows, last], last) if agreement else None
        return out.logits[:, -1], None if out.hidden is None else out.hidden[rows, last], agreed


def _is_causal_lm(draft) -> bool:
    return hasattr(draft, "config") and hasattr(draft, "get_input_embeddings")


def _load(path, target):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device).eval()


# the catch-all kind: any transformers causal LM (tried after the heads, block drafters and MTP layers)
KIND = register_kind(DraftKind("model", "a draft model", _is_causal_lm, ModelDrafter, order=100,
                               directory=lambda path: path != "mtp" and Path(path).is_dir(), load=_load,
                               parallel=True, own_tokenizer=True))
