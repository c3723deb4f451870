"""The registry of draft kinds: how a ``draft`` argument (a model, a head, a directory) is
recognised and made into a :class:`~spec_ext.drafters.base.Drafter`, and what it can do.
``generate`` asks this registry only; it never tests a draft's type. A new draft source is one
file with its drafter and one :func:`register_kind` call (``docs/architecture.md``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from spec_ext.drafters.base import Drafter
from spec_ext.drafters.mixed import MixedDrafter
from spec_ext.drafters.text import TextSource
from spec_ext.policies import Policy


@dataclass(frozen=True)
class DraftKind:
    """One kind of draft.

    ``recognise(draft)``: whether a loaded draft is of this kind; ``make(draft, hidden)``: its
    drafter (``hidden``: the plans read its hidden state); ``directory(path)`` and
    ``load(path, target)``: whether a directory (or the name ``"mtp"``) holds one and how it is
    loaded (None: not from a directory). What it can do: ``parallel`` (draft beside the
    target's verification: the parallel engines), ``agreement`` (its catch-up tells the bonus
    agreement AdaLength reads), ``own_tokenizer`` (a draft of another tokenizer can be this
    kind). Every kind drafts chains and trees and takes the text beside it (per row, as the
    plan says); ``describe`` names it in errors, ``why_not_parallel`` says why it cannot."""
    name: str
    describe: str
    recognise: Callable[[object], bool]
    make: Callable[[object, bool], Drafter]
    order: int = 50  # kinds are tried in this order (the causal LM, which takes any model, last)
    directory: Callable[[Path], bool] | None = None
    load: Callable[[Path, object], object] | None = None
    parallel: bool = False
    agreement: bool = True
    own_tokenizer: bool = False
    why_not_parallel: str = "its drafts read the hidden states of the very verification it would run beside"


KINDS: list[DraftKind] = []


def register_kind(kind: DraftKind) -> DraftKind:
    """Add ``kind`` to the registry (a kind of the same name is replaced)."""
    KINDS[:] = sorted([k for k in KINDS if k.name != kind.name] + [kind], key=lambda k: k.order)
    return kind


def kind_of(draft) -> DraftKind:
    """The kind of a loaded ``draft`` (ValueError naming ``draft`` where none recognises it)."""
    for kind in KINDS:
        if kind.recognise(draft):
            return kind
    raise ValueError(f"draft: expected a causal LM, a feature head, a block drafter, MTP layers, a Drafter, a "
                     f"directory or None, got {type(draft).__name__}")


def load(path, target):
    """The draft in the directory ``path`` (or ``"mtp"``: the target's own MTP layers), as the
    first kind whose ``directory`` recognises it loads it, in the target's dtype and on its device."""
    config = Path(path) / "config.json"
    if str(path) != "mtp" and config.is_file():
        try:
            json.loads(config.read_text())
        except ValueError as error:
            raise ValueError(f"draft: {config} is not valid JSON ({error})") from None
    for kind in KINDS:
        if kind.directory is not None and kind.directory(path if str(path) == "mtp" else Path(path)):
            return kind.load(Path(path), target)
    raise ValueError(f"draft: {str(path)!r} is not a directory (a causal LM's, a head's or a block drafter's) "
                     f"nor 'mtp'")


def build(draft, policy: Policy) -> MixedDrafter:
    """The call's drafting for ``draft`` (a loaded draft or None) under ``policy``: its kind's
    drafter and, where the policy drafts the rows' text, a :class:`TextSource` beside it.
    Refusals follow from what the kind can do, and name the argument."""
    model = None
    if draft is not None and policy.drafts:
        kind = kind_of(draft)
        name = type(policy).__name__
        if policy.parallel and not kind.parallel:
            raise ValueError(f"policy: {name} drafts while the target verifies, which {kind.describe} cannot: "
                             f"{kind.why_not_parallel} (use a draft model for parallel drafting)")
        model = kind.make(draft, policy.reads_draft_hidden)
        if not kind.agreement and policy.reads_agreement:
            raise ValueError(f"policy: {name} reads the drafter's agreement with the token after a fully accepted "
                             f"round; {kind.describe} has no slot past its drafts to agree with")
    text = policy.text_settings(model is not None)
    if model is None and text is None and policy.needs_model and not policy.drafts_elsewhere:
        raise ValueError(f"draft: required with policy {type(policy).__name__} (None only with a policy that drafts "
                         f"from the text, NGram or Suffix, or whose draft runs on another rank, e.g. "
                         f"PEARL(mode='distributed'))")
    return MixedDrafter(model, None if text is None else TextSource(text))


register_kind(DraftKind("drafter", "a Drafter", lambda draft: isinstance(draft, Drafter), lambda draft, hidden: draft,
                        order=0))
