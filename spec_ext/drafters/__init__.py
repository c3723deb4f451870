"""Drafters: what proposes each round's drafts, behind one interface (:class:`Drafter`).

| kind | drafter | drafts | state it keeps in step with the target |
|---|---|---|---|
| a draft model | :class:`ModelDrafter` | chains, trees | its KV cache |
| a feature head (EAGLE-1/3) | :class:`HeadDrafter` | chains, trees, from the target's hidden states | its KV cache |
| MTP layers (``draft="mtp"``) | :class:`MtpDrafter` | chains, trees | their KV cache |
| a block drafter (DFlash, P-EAGLE) | :class:`BlockDrafter` | a block per forward: chains, trees | its context KV cache |
| a draft of another tokenizer | :class:`OtherTokenizerDrafter` | chains, trees of target ids (TLI, SLEM) | its text, its KV cache |
| the rows' text | :class:`TextSource` | each row's own text, a suffix cache's (n-gram, suffix decoding) | an index per row |

:func:`build` makes a call's :class:`MixedDrafter`: the kind's drafter (the registry of
:mod:`spec_ext.drafters.kinds`: how each kind is recognised, loaded and what it can do) and,
where the policy drafts the rows' text, a :class:`TextSource` beside it; each round's plan
says per row which of them drafts it, and :func:`merge` makes one :class:`Proposal` of the
rows. The engine verifies the one shape or the other and never asks which drafter it has.
"""
from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler, check_finite, grow_tree, pad_rows
from spec_ext.drafters.kinds import KINDS, DraftKind, build, kind_of, load, register_kind
from spec_ext.drafters.mixed import MixedDrafter, merge
from spec_ext.drafters.text import TextSource
from spec_ext.drafters.model import ModelDrafter
from spec_ext.drafters.head import HeadDrafter
from spec_ext.drafters.mtp import MtpDrafter
from spec_ext.drafters.block import BlockDrafter
from spec_ext.drafters.other_tokenizer import OtherTokenizerDrafter

__all__ = ["KINDS", "BlockDrafter", "DraftKind", "Drafter", "HeadDrafter", "MixedDrafter", "ModelDrafter",
           "MtpDrafter", "OtherTokenizerDrafter", "Outcome", "Proposal", "Sampler", "TextSource", "build",
           "check_finite", "grow_tree", "kind_of", "load", "merge", "pad_rows", "register_kind"]
