"""The target's own multi-token-prediction layers (:mod:`spec_ext.models.mtp`) as a drafter,
reading the target's last hidden state from the verification forward itself."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler, draft_chain, grow_tree, pad_rows
from spec_ext.drafters.kinds import DraftKind, register_kind
from spec_ext.drafters.features import committed_features, join_columns, prompt_features
from spec_ext.models import SpecCache, check_model, num_layers, vocabulary_size
from spec_ext.models.mtp import (LeanMtp, is_mtp_directory, layer_step, load_speculators_mtp, mtp_logits,
                                 position_shift, spec_attention, why_not_lean_mtp, why_not_mtp)
from spec_ext.policies import RoundPlan


class MtpDrafter(Drafter):
    """Drafts with the K MTP layers of the target's checkpoint (``MtpModel``), as transformers
    computes them: draft i (1 <= i <= K) is layer i-1's, at the last index n of the committed
    text (n + 2 tokens, x_{n+1} the root), from layer i-2's output there (layer 0: the
    target's hidden state h_n) and the embedding of the token before it (draft i-1; the root
    for draft 1). A chain longer than K re-applies the last layer to its own output at
    indices n+1, n+2, ... (as vLLM does); trees (``Tree``, ``DynamicTree``: top-k children),
    a node at depth d drafting its children with layer min(d + 1, K) - 1 as chains do.

    State: one :class:`SpecCache` layer per MTP layer, all of one length per row: the indices
    every layer has seen with committed tokens only (layer i at index p reads tokens up to
    x_{p+i+1}, so after a round the last K - 1 computed indices are recomputed with what was
    committed: ``MTPCandidateGenerator``'s cache correction). What it has not seen (the
    target's hidden states of those indices and of the round's committed tokens) waits on the
    device and is run through every layer at the next round's start, each layer in one
    forward; each layer's last output drafts its step. A one-token prompt has no hidden state:
    its first round reads a zero one, never kept.

    Llama-family MTP blocks (``spec_ext.models.mtp.why_not_lean_mtp`` None) run through
    :class:`~spec_ext.models.mtp.LeanMtp` (the same numbers as the modules, without their
    per-call machinery), decided at each ``start``; others, and MTP models forced with
    ``spec_ext.models.hf_modules(mtp)``, through the HF modules.

    Example:
        >>> spec_ext.generate(target, "mtp", ids)    # doctest: +SKIP
    """

    drafts_every_round = True  # its catch-up over the target's features is the round's first forward

    def __init__(self, mtp, hidden: bool = False):
        self.mtp = mtp.eval()
        self.num_mtp = self.chain_length = len(mtp.layers)  # Fixed(): one draft per layer, as transformers' use_mtp
        self.shift = position_shift(mtp)  # layer i at index p runs at position p + i + shift
        self.hidden = hidden

    @property
    def proposer(self):
        return self.mtp

    def bind(self, target) -> None:
        check_model(target, "target")
        reason = why_not_mtp(self.mtp.config)
        if reason is not None:
            raise ValueError(f"draft: these MTP layers cannot draft: {reason}")
        if self.mtp.embed_tokens is not target.get_input_embeddings() and \
                self.mtp.embed_tokens.weight.shape != target.get_input_embeddings().weight.shape:
            raise ValueError("draft: these MTP layers were loaded for another model (their embedding is not the "
                             "target's); load them with spec_ext.models.mtp.load_mtp(target)")
        self.target_layers = (num_layers(target),)
        self.vocab_size = vocabulary_size(target)

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        self.sampler, self.generator, self.calls = sampler, generator, 0
        self.lean = None if why_not_lean_mtp(self.mtp) else LeanMtp(self.mtp)
        self.all_accepted = self.bonus_p = None
        weight = self.mtp.layers[0].eh_proj.weight
        self.device, dtype = weight.device, weight.dtype
        B, width = len(seqs), self.mtp.config.hidden_size
        self.cache = SpecCache(self.num_mtp, None, None, B, capacity, dtype, self.device)
        features = prompt_features(features, B, width, dtype, self.device)
        self.fake = [len(s) == 1 for s in seqs]
        self.span = [max(1, len(s) - 1) for s in seqs]
        hidden = F.pad(features.to(dtype), (0, 0, 0, max(self.span) - features.shape[1]))
        self.pending = hidden.masked_fill(torch.tensor(self.fake, device=self.device)[:, None, None], 0)

    # ------------------------------------------------------------------ a round
    def _step(self, layer: int, ids: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor | None = None) -> Tensor:
        self.calls += 1
        if self.lean is not None:
            return self.lean.step(layer, ids, hidden, positions, self.cache, mask)
        with spec_attention(self.mtp):
            return layer_step(self.mtp, layer, ids, hidden, positions, self.cache, mask)

    def _logits(self, hidden: Tensor) -> Tensor:
        logits = mtp_logits(self.mtp, hidden)
        if logits.shape[-1] != self.vocab_size:  # a padded head: the target's columns
            logits = logits[..., :self.vocab_size] if logits.shape[-1] > self.vocab_size else \
                F.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=torch.finfo(logits.dtype).min)
        return logits

    def propose(self, seqs: list[list[int]], roots: Tensor, plan: RoundPlan, forced: Tensor | None = None,
                forced_rows: Tensor | None = None) -> Proposal:
        B, K, device = len(seqs), self.num_mtp, self.device
        span, valid = self.span, self.cache.host_lengths
        first = [v - f for v, f in zip(valid, self.fake)]  # the sequence index of each row's first input
        budget = None if plan.tree is not None else plan.budget()
        M, kmax = max(span), max(1, plan.tree.room if plan.tree is not None else max(budget))
        # the tokens x_{first+1} ... x_{n+1} (the root) of every row, then room for its drafts (and for every
        # layer's window over the committed indices)
        text = [s[p + 1:p + 1 + m] for s, p, m in zip(seqs, first, span)]
        tokens = pad_rows(text, 0, device, width=M + max(kmax, K))
        span_t = torch.tensor(span, device=device)
        first_t = torch.tensor(first, device=device)
        positions = first_t[:, None] + self.shift + torch.arange(M, device=device)  # layer 0's: index + shift
        rows, last = torch.arange(B, device=device), span_t - 1
        self._valid, self._layers_run, self._tree_round = list(valid), 1, False
        out = self._step(0, tokens[:, :M], self.pending[:, :M], positions)  # rows that finished may have been wider
        if K == 1:  # every layer has its catch-up: the cache keeps it until commit says how much
            self.cache.advance(span, span_t)
        logits = self._logits(out[rows, last])
        agreement = None  # layer 0 at index p predicts x_{p+2}: the bonus is tokens[last]
        if plan.reads_agreement:
            before = self._logits(out[rows, (last - 1).clamp_min(0)])
            agreement = self.bonus_agreement(before, tokens[rows, last], last)
            budget = plan.budget(agreement)
        if plan.tree is not None:
            return self._tree(plan, out, logits, roots, first_t, span_t, tokens, positions)
        state = {"drafts": 0, "out": out, "hidden": out[rows, last]}

        def step(token: Tensor) -> tuple[Tensor, Tensor | None]:
            i = state["drafts"] = state["drafts"] + 1  # drafts so far; layer i drafts the next
            token = token.clamp_min(0)
            tokens.scatter_(1, (span_t + i - 1)[:, None], token[:, None])
            if i < K:  # layer i over the same indices, its tokens one further on
                state["out"] = self._step(i, tokens[:, i:i + M], state["out"], positions + i)
                self._layers_run = i + 1
                if i == K - 1:
                    self.cache.advance(span, span_t)
                state["hidden"] = state["out"][rows, last]
            else:  # past the layers: the last one again, one index on, from its own output
                at = first_t + span_t + i + self.shift - 1  # index n + i - K + 1, position index + K - 1 + shift
                state["hidden"] = self._step(K - 1, token[:, None], state["hidden"][:, None], at[:, None])[:, 0]
                self.cache.advance([1] * B)
            return self._logits(state["hidden"]), state["hidden"] if self.hidden else None

        drafts, q, num_draft, confidence = draft_chain(plan, self.sampler, self.generator, logits,
                                                       state["hidden"] if self.hidden else None, step, budget)
        if self._layers_run < K:  # the chain stopped before the last layer: the rest catch up on the committed
            # indices, so the cache keeps what every layer saw (not recomputed next round); the drafts in
            # place (the last one was never stepped), read by the indices an accepted draft keeps
            tokens.scatter_(1, span_t[:, None] + torch.arange(drafts.shape[1], device=device), drafts.clamp_min(0))
            for i in range(self._layers_run, K):
                state["out"] = self._step(i, tokens[:, i:i + M], state["out"], positions + i)
            self._layers_run = K
            self.cache.advance(span, span_t)
        return Proposal(drafts, num_draft, q, confidence=confidence)

    def _tree(self, plan: RoundPlan, out: Tensor, logits: Tensor, roots: Tensor, first_t: Tensor, span_t: Tensor,
              tokens: Tensor, positions: Tensor) -> Proposal:
        """A static tree (``Tree``) or EAGLE-2's (``DynamicTree``): the children of a node at
        depth d are drafted by layer min(d + 1, K) - 1, as a chain's draft d + 1 is. Layer l runs
        at index n - l + j for a node at depth j (the root x_{n+1} at n - l, its last committed
        index) from layer l-1's output for the node's parent there (layer l's own past the
        layers; the root's: layer l-1's catch-up at n - l, the target's h_n for layer 0),
        attending to its committed indices and the node's ancestors. Each level re-feeds the
        root and the tree so far through its layer; a node at an index below the row's first
        (a short prompt's first round) does not exist, as in a chain, and nothing sees it."""
        B, K, device = len(roots), self.num_mtp, self.device
        rows, M, valid, span = torch.arange(B, device=device), positions.shape[1], self._valid, self.span
        if K == 1:
            self.cache.rollback(valid, self.cache.lengths - span_t)
        catch = [out]  # every layer over the committed indices (columns past span - 1 - l read no committed token)
        for layer in range(1, K):
            catch.append(self._step(layer, tokens[:, layer:layer + M], catch[-1], positions + layer))
        self._layers_run = K
        root_col = [(span_t - 1 - layer).clamp_min(0) for layer in range(K)]
        root_in = [self.pending[rows, span_t - 1]] + [catch[layer - 1][rows, root_col[layer]] for layer in range(1, K)]
        outs = {layer: catch[layer][rows, root_col[layer]][:, None] for layer in range(K)}  # A(layer, root)
        level = [0]

        def refeed(nodes: Tensor, parents: Tensor, depth: Tensor, mask: Tensor) -> Tensor:
            level[0] += 1
            layer = min(level[0], K - 1)
            width = root_in[0].shape[-1]
            parent = parents[:, 1:].clamp_min(0)

            def of(source: Tensor) -> Tensor:
                index = parent.clamp(max=source.shape[1] - 1)
                return source.gather(1, index[..., None].expand(-1, -1, width))

            own = of(outs[layer])
            hidden_in = own if layer == 0 else torch.where((depth[:, 1:] <= layer)[..., None], of(outs[layer - 1]), own)
            hidden_in = torch.cat([root_in[layer][:, None], hidden_in], 1)
            if min(span) - 1 - layer < 0:  # a node at index n - layer + j < first exists in no row's text
                mask = _without(mask, (span_t[:, None] - 1 - layer + depth) >= 0)
            before = root_col[layer]  # layer's committed entries before its root
            self.cache.advance(before.tolist(), before)
            at = (first_t + span_t - 1)[:, None] + depth + self.shift  # index n - layer + j, position + layer + shift
            outs[layer] = self._step(layer, nodes.clamp_min(0), hidden_in, at, mask)
            self.cache.rollback(valid, self.cache.lengths - before)
            return self._logits(outs[layer])

        proposal = grow_tree(plan.tree, logits, roots, refeed, self.sampler)
        self._tree_round = True  # every layer's entries up to index n - K + 1 are committed ones
        kept = (span_t - K + 1).clamp_min(0)
        self.cache.advance(kept.tolist(), kept)
        return proposal

    def commit(self, outcome: Outcome) -> None:
        K, accepted = self.num_mtp, outcome.accepted
        first = [v - f for v, f in zip(self._valid, self.fake)]
        last = [p + m - 1 for p, m in zip(first, self.span)]  # n: the last index drafted from
        # computed: the indices every layer has now seen (the fake one of a one-token prompt
        # never counts); the last K of the committed text's indices read a draft past what
        # was accepted, or the bonus's position, through some layer: recomputed next round
        computed = [n - K + 2 if self._tree_round else n + 1 if self._layers_run == K else v
                    for n, v in zip(last, self._valid)]
        kept = [max(0, min(c, n + a + 2 - K)) for c, n, a in zip(computed, last, accepted)]
        self.cache.rollback(kept)
        # what the layers have not seen: the target's hidden states from each row's kept
        # length on, the last round's (those kept waiting) then this round's verified positions
        fresh = committed_features(outcome)[0]
        waiting = [n - k + 1 for n, k in zip(last, kept)]
        (self.pending,), span = join_columns([((self.pending,), [k - p for k, p in zip(kept, first)], waiting),
                                              ((fresh,), [0] * len(accepted), [a + 1 for a in accepted])])
        self.span, self.fake = span, [False] * len(accepted)
        self.remember_bonus(outcome)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.cache.keep_rows(rows)
        self.pending = self.pending[index]
        self.span, self.fake = [self.span[i] for i in rows], [self.fake[i] for i in rows]
        self.keep_bonus_rows(index)


def _without(mask: Tensor, exists: Tensor) -> Tensor:
    """Tree bits ``mask`` [B|1,T,W] int32 with every node j where ``exists[b, j]`` [B,T] is
    False unseen by the others (each node still sees itself)."""
    B, T = exists.shape
    W = mask.shape[-1]
    weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64, device=mask.device)

    def pack(bits: Tensor) -> Tensor:
        packed = (F.pad(bits, (0, W * 32 - T)).view(*bits.shape[:-1], W, 32).long() * weights).sum(-1)
        return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)

    eye = pack(torch.eye(T, dtype=torch.bool, device=mask.device))
    return (mask.expand(B, -1, -1) & pack(exists)[:, None]) | eye[None]


def _load(path, target):
    if str(path) == "mtp":  # the target's own MTP layers, from its checkpoint
        from spec_ext.models.mtp import load_mtp
        return load_mtp(target)
    return load_speculators_mtp(path, target)


KIND = register_kind(DraftKind("mtp", "the target's MTP layers", lambda draft: type(draft).__name__ == "MtpModel",
                               MtpDrafter, order=10, directory=lambda path: path == "mtp" or is_mtp_directory(path),
                               load=_load))
