"""Drafters: what proposes each round's drafts, behind one interface (:class:`Drafter`).

| drafter | drafts | state it keeps in step with the target |
|---|---|---|
| :class:`ModelDrafter` | a draft model's chain (length policies), ``Tree`` or ``DynamicTree`` | its KV cache |
| :class:`TextDrafter` | each row's own text: chains or trees of continuations (``NGram``) | an n-gram index per row |
| :class:`TextFirst` | the text, and the draft model (either tokenizer) for the rows without a match | both |
| :class:`HeadDrafter` | an EAGLE-1/3 head on the target's hidden states: chains or trees | its KV cache |
| :class:`MtpDrafter` | the target checkpoint's own MTP layers (``draft="mtp"``) or a speculators ``mtp`` directory: chains or trees | their KV cache |
| :class:`BlockDrafter` | a DFlash block drafter: a block of drafts per forward, chains or trees | its context KV cache |
| :class:`OtherTokenizerDrafter` | a draft model with another tokenizer: chains or trees of target ids (TLI, SLEM) | its tokens of the text, its KV cache |

A drafter returns a :class:`Proposal` (a chain or a tree, with the q each draft was drawn
from, or None for deterministic drafts) and is told the :class:`Outcome`; the engine
verifies the one shape or the other and never asks which drafter it has. :func:`build`
makes the drafter that ``generate`` uses for a ``draft`` argument and a policy.
"""
from pathlib import Path

from spec_ext.drafters.base import Drafter, Outcome, Proposal, Sampler, check_finite, pad_rows, prefill
from spec_ext.drafters.model import ModelDrafter
from spec_ext.drafters.text import TextDrafter
from spec_ext.drafters.text_first import TextFirst
from spec_ext.drafters.head import HeadDrafter
from spec_ext.drafters.text_beside_head import TextBesideHead
from spec_ext.drafters.mtp import MtpDrafter
from spec_ext.drafters.block import BlockDrafter
from spec_ext.drafters.other_tokenizer import OtherTokenizerDrafter
from spec_ext.models.dflash import DFlashDraft, is_dflash_directory, load_dflash
from spec_ext.models.eagle import EagleHead, is_head_directory, load_head
from spec_ext.models.mtp import is_mtp_directory, load_speculators_mtp
from spec_ext.policies import Policy, Suffix


def load(path: str | Path, target):
    """The draft in the directory ``path``: a DFlash block drafter or a feature head (known by
    their configs: see :func:`spec_ext.models.dflash.is_dflash_directory` and
    :func:`spec_ext.models.eagle.is_head_directory`) or a causal LM, in the target's dtype
    and on its device."""
    if str(path) == "mtp":  # the target's own MTP layers, from its checkpoint
        from spec_ext.models.mtp import load_mtp
        return load_mtp(target)
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"draft: {str(path)!r} is not a directory (a causal LM's or a head's)")
    if is_mtp_directory(path):  # a speculators mtp directory: one MTP layer for this target
        return load_speculators_mtp(path, target)
    if is_dflash_directory(path):
        return load_dflash(path)
    if is_head_directory(path):
        return load_head(path)
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device).eval()


def build(draft, policy: Policy) -> Drafter | None:
    """The drafter for ``draft`` (a :class:`Drafter`, returned as it is; an
    :class:`~spec_ext.models.eagle.EagleHead`; a :class:`~spec_ext.models.dflash.DFlashDraft`;
    a causal LM; or None) under ``policy``: the
    text where the policy drafts from the text (beside the model, if one is given), else
    the model or head. None: no drafter here (a draft on another rank, or no draft where
    the policy needs one; the caller says which)."""
    if isinstance(draft, Drafter):
        return draft
    if type(draft).__name__ == "MtpModel":  # transformers' MtpModel (spec_ext.models.mtp.load_mtp)
        if policy.parallel or policy.drafts_from_text:
            raise ValueError(f"policy: {type(policy).__name__} with the target's MTP layers is not supported (they "
                             f"read the hidden states of the verification itself; Auto drafts the text beside them)")
        return _beside_text(MtpDrafter(draft, policy), policy)
    if isinstance(draft, DFlashDraft):
        if policy.parallel:
            raise ValueError(f"policy: {type(policy).__name__} drafts while the target verifies, but a block "
                             f"drafter's next block reads the hidden states that very verification produces: it has "
                             f"nothing to draft from in parallel (use a draft model for parallel drafting)")
        if policy.drafts_from_text:
            raise ValueError(f"policy: {type(policy).__name__} with a block drafter is not supported (text drafts "
                             f"run beside it under Auto, which chooses per row)")
        return _beside_text(BlockDrafter(draft, policy), policy)
    if isinstance(draft, EagleHead):
        if policy.parallel:
            raise ValueError(f"policy: {type(policy).__name__} drafts while the target verifies, but a feature "
                             f"head's next drafts read the hidden states that very verification produces: it has "
                             f"nothing to draft from in parallel (use a draft model for parallel drafting)")
        if isinstance(policy, Suffix):  # the text's (the cache's) trees beside the head's chains
            return TextBesideHead(TextDrafter(policy), HeadDrafter(draft, policy))
        if policy.drafts_from_text:
            raise ValueError(f"policy: {type(policy).__name__} with a feature head is not supported yet (text "
                             f"drafts run alone or beside a draft model; Auto, the default, drafts the text "
                             f"beside a head)")
        return _beside_text(HeadDrafter(draft, policy), policy)
    if policy.drafts_from_text:
        text = TextDrafter(policy)
        return text if draft is None else TextFirst(text, ModelDrafter(draft, policy))
    return None if draft is None else _beside_text(ModelDrafter(draft, policy), policy)


def _beside_text(drafter: Drafter, policy: Policy) -> Drafter:
    """``drafter``, with the rows' text beside it where the policy chooses per row what drafts
    (its ``text_beside_draft``: the matcher's settings; :class:`spec_ext.policies.Auto`)."""
    text = getattr(policy, "text_beside_draft", None)
    return drafter if text is None else TextFirst(TextDrafter(text), drafter, chooser=policy)


__all__ = ["BlockDrafter", "Drafter", "HeadDrafter", "ModelDrafter", "MtpDrafter", "OtherTokenizerDrafter", "Outcome", "Proposal", "Sampler",
           "TextBesideHead", "TextDrafter", "TextFirst", "build", "check_finite", "load", "pad_rows", "prefill"]
