"""A block drafter (DFlash, :mod:`spec_ext.models.dflash`): one drafter forward per round
proposes the whole block, from the target's hidden states tapped from the verification."""
from __future__ import annotations

from torch import Tensor

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler, from_slots
from spec_ext.drafters.features import bind_layers, check_draft_vocabulary, committed_features, prompt_features
from spec_ext.models import SpecCache, check_model, num_layers, vocabulary_size
from spec_ext.drafters.kinds import DraftKind, register_kind
from spec_ext.models.dflash import DFlashDraft, is_dflash_directory, load_dflash
from spec_ext.policies import RoundPlan


class BlockDrafter(Drafter):
    """Drafts a chain (up to the block's b - 1 slots, cut by the round's plan) or a tree (the
    plan's, static or dynamic, at most the block's slots deep) from one block forward;
    ``hidden``: plans that stop per draft step read the normed outputs of the slots.

    Draft j is drawn from slot j's logits as processed after the drafts before it (greedy: its
    argmax); the slots do not depend on the drafts, so chain rejection sampling with these q is
    exact. A tree's children at depth d + 1 are top-k of slot d + 1 (``docs/block_drafters.md``).

    State: the drafter's :class:`SpecCache` holds, per layer, the context keys/values of every
    committed position before the anchor (the root), one entry per position, made from the
    target's features: the prompt's in :meth:`start`, the committed positions' of each round
    (the root and the accepted drafts) in :meth:`commit`. The block itself is scratch past
    the context; nothing drafted is ever kept, so nothing is rolled back.

    Example:
        >>> spec_ext.generate(target, BlockDrafter(load_dflash("path/to/dflash")), ids)  # doctest: +SKIP
    """

    reads_on_commit = True

    def __init__(self, draft: DFlashDraft, hidden: bool = False):
        self.draft = draft.eval()
        self.hidden = hidden

    @property
    def proposer(self):
        return self.draft

    @property
    def num_drafts(self) -> int:
        """The most drafts one block proposes (b - 1, or b with ``sample_from_anchor``)."""
        return self.draft.config.num_drafts

    # one forward proposes a chain of up to its slots, or a tree as deep
    drafts_per_forward = max_depth = chain_length = property(lambda self: self.num_drafts)

    def bind(self, target) -> None:
        check_model(target, "target")
        draft, config = self.draft, self.draft.config
        L = num_layers(target)
        if config.num_target_layers is not None and config.num_target_layers != L:
            raise ValueError(f"num_target_layers: the drafter was made for a target of {config.num_target_layers} "
                             f"layers, this one has {L}")
        self.target_layers = bind_layers(target, config.layer_ids, config.target_hidden_size or draft.hidden_size,
                                         "aux_hidden_state_layer_ids", "target_hidden_size")
        self.vocab_size = vocabulary_size(target)
        if draft.layer_config.vocab_size != self.vocab_size:
            raise ValueError(f"transformer_layer_config.vocab_size: {draft.layer_config.vocab_size}, the target's "
                             f"vocabulary has {self.vocab_size}")
        check_draft_vocabulary(draft.d2t, self.vocab_size)
        self.embedding = None if draft.embed_tokens is not None else target.get_input_embeddings().weight
        self.output = None if draft.lm_head is not None else target.get_output_embeddings().weight
        for name, weight in (("embed_tokens", self.embedding), ("lm_head", self.output)):
            if weight is not None and weight.shape[1] != draft.hidden_size:
                raise ValueError(f"{name}: the drafter has none and the target's are {weight.shape[1]} wide, not "
                                 f"the drafter's transformer_layer_config.hidden_size {draft.hidden_size}")
        draft.to(device=target.device, dtype=target.dtype)

    def start(self, seqs: list[list[int]], capacity: int, sampler: Sampler, generator=None,
              features: Tensor | None = None) -> None:
        self.sampler, self.generator, self.calls = sampler, generator, 0
        weight = self.draft.fc.weight
        B = len(seqs)
        # the context never exceeds the committed tokens; the block is written past it as scratch
        self.cache = SpecCache(self.draft.num_layers, None, None, B, capacity + self.draft.block_size, weight.dtype,
                               weight.device)
        features = prompt_features(features, B, self.draft.feature_width, weight.dtype, weight.device)
        self.draft.extend(self.draft.project(features), self.cache, [len(s) - 1 for s in seqs])

    def block(self, roots: Tensor, slots: int | None = None) -> tuple[Tensor, Tensor]:
        """One block forward from each row's root [B]: the first ``slots`` drafts' logits
        [B,K,V] float32 over the target's vocabulary (K = ``slots``, default :attr:`num_drafts`;
        slot first_slot + j at j) and the outputs their head read [B,K,H]."""
        self.calls += 1
        draft = self.draft
        hidden = draft(draft.embed(draft.block_tokens(roots), self.embedding), self.cache, slots or self.num_drafts)
        return draft.logits(hidden, self.output, self.vocab_size), hidden

    def propose(self, seqs: list[list[int]], roots: Tensor, plan: RoundPlan, forced: Tensor | None = None,
                forced_rows: Tensor | None = None) -> Proposal:
        slots, budget = plan.slots(self.num_drafts)
        slots = max(1, slots)
        logits, hidden = self.block(roots, slots)
        proposal = from_slots(plan, logits, self.draft.norm(hidden) if self.hidden else None, roots, self.sampler,
                              self.generator, budget)
        proposal.draft_steps = slots
        return proposal

    def commit(self, outcome: Outcome) -> None:
        features, _, counts, counts_t = committed_features(outcome)
        self.draft.extend(self.draft.project(features.to(self.draft.fc.weight.dtype)), self.cache, counts, counts_t)

    def keep_rows(self, rows: list[int], index: Tensor) -> None:
        self.cache.keep_rows(rows)


KIND = register_kind(DraftKind("block", "a block drafter", lambda draft: isinstance(draft, DFlashDraft), BlockDrafter,
                               directory=lambda path: path != "mtp" and is_dflash_directory(path),
                               order=40, load=lambda path, target: load_dflash(path), agreement=False))
