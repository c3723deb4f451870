"""Drafters: what proposes each round's drafts, behind one interface (:class:`Drafter`).

| drafter | drafts | state it keeps in step with the target |
|---|---|---|
| :class:`ModelDrafter` | a draft model's chain (length policies) or static top-k tree (``Tree``) | its KV cache |
| :class:`TextDrafter` | each row's own text: chains or trees of continuations (``NGram``) | an n-gram index per row |
| :class:`TextFirst` | the text, and the draft model for the rows without a match | both |

A drafter returns a :class:`Proposal` (a chain or a tree, with the q each draft was drawn
from, or None for deterministic drafts) and is told the :class:`Outcome`; the engine
verifies the one shape or the other and never asks which drafter it has. :func:`build`
makes the drafter that ``generate`` uses for a ``draft`` argument and a policy.
"""
from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler, check_finite, pad_rows, prefill
from spec_ext.drafters.model import ModelDrafter
from spec_ext.drafters.text import TextDrafter
from spec_ext.drafters.text_first import TextFirst
from spec_ext.policies import Policy


def build(draft, policy: Policy) -> Drafter | None:
    """The drafter for ``draft`` (a :class:`Drafter`, returned as it is; a causal LM; or
    None) under ``policy``: the text where the policy drafts from the text (beside the
    model, if one is given), else the model. None: no drafter here (a draft on another
    rank, or no draft where the policy needs one; the caller says which)."""
    if isinstance(draft, Drafter):
        return draft
    if policy.drafts_from_text:
        text = TextDrafter(policy)
        return text if draft is None else TextFirst(text, ModelDrafter(draft, policy))
    return None if draft is None else ModelDrafter(draft, policy)


__all__ = ["Drafter", "ModelDrafter", "Outcome", "Proposal", "Sampler", "TextDrafter", "TextFirst", "build",
           "check_finite", "pad_rows", "prefill"]
