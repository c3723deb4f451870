"""A feature head (EAGLE-1 / EAGLE-3, :mod:`spec_ext.models.eagle`) drafts from the target's
own hidden states, tapped from the verification forward itself (no extra target pass)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler, catch_up_columns, draft_chain, feed_rows, \
    from_slots, grow_tree, pad_rows, refeed_tree
from spec_ext.drafters.features import bind_layers, check_draft_vocabulary, committed_features, join_columns, \
    prompt_features
from spec_ext.models import SpecCache, aux_layer_ids, check_model, num_layers, vocabulary_size
from spec_ext.drafters.kinds import DraftKind, register_kind
from spec_ext.models.eagle import EagleHead, is_head_directory, load_head
from spec_ext.policies import RoundPlan


class HeadDrafter(Drafter):
    """Drafts a chain with ``head`` (as far as the round's plan says) or a tree (the plan's:
    static top-k, or EAGLE-2's dynamic one); ``hidden``: plans that stop per draft step read
    what the head's output layer read.

    State: the head's own :class:`SpecCache` holds one entry per committed position t < n
    (n + 1 committed tokens, x_n the root): the head's pass over (token x_{t+1}, the target's
    feature at t). What it has not seen yet (the last round's committed tokens with the
    target's features at the positions that verified them) waits on the device and is fed
    at the start of its next round (a round it skips adds its own to it: :meth:`skip`); the
    draft steps past it use the head's own hidden state
    and are always rolled back (the accepted ones come back with the target's features).

    Plans that read the bonus agreement (AdaLength) get it from the catch-up, whose pairs
    after a round are its accepted drafts then the bonus, the one before the bonus predicting it.

    Example:
        >>> spec_ext.generate(target, HeadDrafter(load_head("path/to/head")), ids)  # doctest: +SKIP
    """

    def __init__(self, head: EagleHead, hidden: bool = False):
        self.head = head.eval()
        self.hidden = hidden

    @property
    def proposer(self):
        return self.head

    def skip(self) -> None:
        """A round without the head (the text drafted every row): no forward; its next proposal
        catches up over what it has not seen."""
        self._waiting = True

    def bind(self, target) -> None:
        check_model(target, "target")
        config, head = self.head.config, self.head
        if config.kind == "eagle3":
            ids = config.layer_ids if config.layer_ids is not None else aux_layer_ids(target)
            self.target_layers = bind_layers(target, ids, config.target_hidden_size or head.hidden_size,
                                             "eagle_aux_hidden_state_layer_ids", "target_hidden_size")
        else:
            self.target_layers = bind_layers(target, (num_layers(target),), head.hidden_size, "target layers",
                                             "transformer_layer_config.hidden_size")
        # the head's vocabulary and the target's may differ by padding (as a draft model's may):
        # its drafts must be target tokens, and a token its own embedding lacks reaches it as 0
        self.vocab_size = vocabulary_size(target)
        check_draft_vocabulary(head.d2t if config.kind == "eagle3" else None, self.vocab_size)
        own = head.embed_tokens
        self.own_vocab = own.num_embeddings if own is not None and own.num_embeddings < self.vocab_size else None
        self.embed = own if own is not None else target.get_input_embeddings()
        self.target_head = target.get_output_embeddings()
        if own is None and self.embed.weight.shape[1] != head.hidden_size:
            raise ValueError(f"embed_tokens: the head has none and the target's are {self.embed.weight.shape[1]} "
                             f"wide, not the head's {head.hidden_size}")
        self.head.to(device=target.device, dtype=target.dtype)

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        self.sampler, self.generator, self.calls = sampler, generator, 0
        self.all_accepted = self.bonus_p = None
        self._waiting = False  # the last round skipped the head: its pending pairs still wait (skip)
        self.device = self.head.fc.weight.device
        B = len(seqs)
        self.cache = SpecCache(self.head.num_layers, None, None, B, capacity, self.head.fc.weight.dtype, self.device)
        tokens = pad_rows(seqs, 0, self.device)
        features = prompt_features(features, B, self._feature_width(), self.head.fc.weight.dtype, self.device)
        # the pairs (x_{t+1}, feature_t) of each prompt; a one-token prompt has none and is
        # fed (x_0, a zero feature) once, never kept (its cache keeps only real pairs)
        self.real = [len(s) - 1 for s in seqs]
        pairs = [max(1, n) for n in self.real]
        features = F.pad(features, (0, 0, 0, max(pairs) - features.shape[1]))
        one_token = torch.tensor([n == 0 for n in self.real], device=self.device)
        features = features.masked_fill(one_token[:, None, None], 0)
        index = (~one_token).long()
        at = (index[:, None] + torch.arange(max(pairs), device=self.device)).clamp_max(tokens.shape[1] - 1)
        ids = tokens.gather(1, at)
        self._pending = ids, features, pairs, torch.tensor(pairs, device=self.device)
        self._waits: list[tuple[Tensor, Tensor, list[int]]] = []  # skipped rounds' pairs, joined by _settle

    def _feature_width(self) -> int:
        config = self.head.config
        width = config.target_hidden_size or self.head.hidden_size
        return width * (len(self.target_layers) if config.kind == "eagle3" else 1)

    def _step(self, ids: Tensor, hidden: Tensor, positions: Tensor, mask: Tensor | None = None,
              logits_at: Tensor | None = None) -> tuple[Tensor, Tensor]:
        self.calls += 1
        if self.own_vocab is not None:
            ids = ids.masked_fill(ids >= self.own_vocab, 0)
        return self.head(self.embed(ids), hidden, positions, self.cache, mask, target_head=self.target_head,
                         vocab_size=self.vocab_size, logits_at=logits_at)

    def _output_layer_input(self, hidden: Tensor) -> Tensor:
        """What the head's output layer reads [..., H] (SpecDecPP's draft hidden state), from the
        hidden state it feeds back [..., H]: EAGLE-3 feeds back its pre-norm state (unless
        ``norm_output``) and its ``lm_head`` reads ``norm`` of it; EAGLE-1's target lm_head
        reads the fed-back state itself."""
        config = self.head.config
        return self.head.norm(hidden) if config.kind == "eagle3" and not config.norm_output else hidden

    def propose(self, seqs: list[list[int]], roots: Tensor, plan: RoundPlan, forced: Tensor | None = None,
                forced_rows: Tensor | None = None) -> Proposal:
        B = len(seqs)
        self._settle()
        ids, features, pairs, pairs_t = self._pending
        combined = self.head.combine(features)
        slots, budget = plan.slots() if self.head.config.mask_token_id is not None else (0, None)
        if slots > 1:  # P-EAGLE: the catch-up, then slots - 1 masked slots after each row's last pair
            ids, combined = self._with_masked_slots(ids, combined, pairs_t, slots - 1)
        last, rows = pairs_t - 1, torch.arange(B, device=self.device)
        columns = catch_up_columns(last, plan.reads_agreement, max(slots, 1))  # (the LM head at these alone)
        (logits, hidden), _ = feed_rows(self.cache, ids, pairs,
                                        lambda ids, at: self._step(ids, combined, at, logits_at=columns), pairs_t)
        # after a round: its accepted drafts, then the bonus at last
        agreement = self.bonus_agreement(logits[:, 0], ids[rows, last], last) if plan.reads_agreement else None
        logits = logits[:, int(plan.reads_agreement):]  # [B, max(slots, 1), V] from the last on
        self._kept = [n - p + r for n, p, r in zip(self.cache.host_lengths, pairs, self.real)]
        self._kept_t = self.cache.lengths - pairs_t + torch.tensor(self.real, device=self.device) \
            if pairs != self.real else self.cache.lengths
        if slots > 1:
            at = columns[:, int(plan.reads_agreement):]
            hidden = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))
            return from_slots(plan, logits, self._output_layer_input(hidden) if self.hidden else None, roots,
                              self.sampler, self.generator, budget)
        logits, hidden = logits[:, 0], hidden[rows, last]
        if plan.tree is not None:
            return self._tree(plan, logits, hidden, roots, combined[rows, last])
        state = {"hidden": hidden}

        def step(token: Tensor) -> tuple[Tensor, Tensor | None]:
            out, fed_back = self._step(token.clamp_min(0)[:, None], state["hidden"][:, None],
                                       self.cache.lengths[:, None])
            state["hidden"] = fed_back[:, 0]
            self.cache.advance([1] * B)
            return out[:, 0], self._output_layer_input(state["hidden"]) if self.hidden else None

        drafts, q, num_draft, confidence = draft_chain(plan, self.sampler, self.generator, logits,
                                                       self._output_layer_input(hidden) if self.hidden else None,
                                                       step, plan.budget(agreement))
        return Proposal(drafts, num_draft, q, confidence=confidence)

    def _with_masked_slots(self, ids: Tensor, combined: Tensor, pairs_t: Tensor, masked: int
                           ) -> tuple[Tensor, Tensor]:
        """ids [B,P] and their combined features [B,P,H] with ``masked`` slots (the mask token,
        the head's combined ``mask_hidden``) right after each row's ``pairs_t[b]`` real pairs."""
        B, P = ids.shape
        slot = torch.arange(P + masked, device=self.device)[None, :]
        real, mask = slot < pairs_t[:, None], (slot >= pairs_t[:, None]) & (slot < pairs_t[:, None] + masked)
        ids = torch.where(real, F.pad(ids, (0, masked)), torch.where(mask, self.head.config.mask_token_id, 0))
        masked_input = self.head.combine(self.head.mask_hidden.to(combined.dtype))
        combined = torch.where(real[..., None], F.pad(combined, (0, 0, 0, masked)),
                               torch.where(mask[..., None], masked_input, 0))
        return ids, combined

    def _tree(self, plan: RoundPlan, logits: Tensor, hidden: Tensor, roots: Tensor, root_input: Tensor) -> Proposal:
        """A static tree (``Tree``) or EAGLE-2's (``DynamicTree``): each level re-feeds the root
        (its token with the target's feature, at its own position) and the tree so far, each
        node paired with its parent's output."""
        last = {"out": hidden[:, None]}  # each node's output of the last pass (the root's: the catch-up's)

        def refeed(tokens: Tensor, parents: Tensor, depth: Tensor, mask: Tensor) -> Tensor:
            width = root_input.shape[-1]
            from_parents = last["out"].gather(1, parents[:, 1:, None].expand(-1, -1, width))
            hidden_in = torch.cat([root_input[:, None], from_parents], 1)
            out, last["out"] = refeed_tree(self.cache, lambda ids, at, mask: self._step(ids, hidden_in, at, mask),
                                           tokens.clamp_min(0), depth, mask)
            return out

        return grow_tree(plan.tree, logits, roots, refeed, self.sampler)

    def commit(self, outcome: Outcome) -> None:
        features, ids, counts, counts_t = committed_features(outcome)
        self.remember_bonus(outcome)
        if self._waiting:  # the head did not run: its cache is as it was, and the new pairs wait (_settle)
            self._waiting = False
            self._waits.append((ids, features, counts))
            return
        self.cache.rollback(self._kept, self._kept_t)
        self._pending = ids, features, counts, counts_t
        self.real = list(counts)

    def _settle(self) -> None:
        """The pairs of the rounds the head skipped go after those already waiting (a one-token
        prompt's stand-in pair dropped)."""
        if self._waits:
            ids, features, _, _ = self._pending
            B = len(self.real)
            parts = [((ids, features), [0] * B, self.real)] + [((i, f), [0] * B, c) for i, f, c in self._waits]
            (ids, features), total = join_columns(parts)
            self._pending = ids, features, total, torch.tensor(total, device=self.device)
            self.real = list(total)
            self._waits = []

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self._settle()
        self.cache.keep_rows(rows)
        ids, features, pairs, pairs_t = self._pending
        self._pending = ids[index], features[index], [pairs[i] for i in rows], pairs_t[index]
        self.real = [self.real[i] for i in rows]
        self.keep_bonus_rows(index)


KIND = register_kind(DraftKind("head", "a feature head", lambda draft: isinstance(draft, EagleHead), HeadDrafter,
                               directory=lambda path: path != "mtp" and is_head_directory(path),
                               load=lambda path, target: load_head(path)))
