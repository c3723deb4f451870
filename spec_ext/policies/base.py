"""The policy protocol: what the decoding engines ask of a policy, and the registry of
policies by name.

A policy decides how far a drafter goes each round (a *length rule*: ``plan`` and
``keep_drafting``) or what shape it grows (a static tree's ``branching``; the text's
continuation trees of :class:`spec_ext.policies.NGram`). Declared attributes say what else
it needs, so no engine asks which class it is: ``branching`` (not None: a static tree the
draft model grows), ``grows_dynamic_tree`` (EAGLE-2's tree), ``drafts_from_text`` (the drafts come from each row's own
text; a draft model, if given, drafts the rows without a match) and ``parallel`` (the
parallel engine runs it: :class:`spec_ext.policies.PEARL` and its subclasses).

Every policy works with no arguments (published defaults; the learned ones load the
bundled pair's predictors) and can be named by its lower-case class name in ``policy=``.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

import torch
from torch import Tensor


class Policy:
    """Base class and default behaviour of every policy (a fixed number of drafts).

    Calls, per generate call: ``bind(target, draft)`` once; ``start(batch_size, greedy)``
    before the first round; then per round ``plan()``, ``keep_drafting(...)`` after each
    draft step, ``observe(...)`` after the verification, and ``keep_rows(rows)`` when
    finished rows drop out. The serial engine also calls ``select(proposal)`` once per round,
    between the drafter's proposal and its verification.

    Capabilities (class attributes; the engine computes and passes these extras only to
    policies that ask):
      * ``uses_draft_hidden``: ``keep_drafting`` gets the draft's last hidden state;
      * ``uses_target_hidden``: :meth:`see_target` is called after every verification;
      * ``uses_bonus_agreement``: :meth:`see_bonus_agreement` is called before ``plan()``;
      * ``uses_tree_paths``: :meth:`see_tree_path` is called after every tree round.
    """

    max_draft: int = 5
    branching: tuple[int, ...] | None = None  # a static tree: children per node at each depth
    grows_dynamic_tree: ClassVar[bool] = False  # a tree grown by the draft's scores (DynamicTree)
    drafts_from_text: ClassVar[bool] = False
    parallel: ClassVar[bool] = False
    uses_draft_hidden: ClassVar[bool] = False
    uses_target_hidden: ClassVar[bool] = False
    uses_bonus_agreement: ClassVar[bool] = False
    uses_tree_paths: ClassVar[bool] = False

    def bind(self, target, draft) -> None:
        """Called once per generate call with the models (draft None when it runs on another rank)."""

    def see_draft_shape(self, drafts_per_forward: int) -> None:
        """Once per generate call, after ``bind``: how many drafts one draft forward proposes
        (1: each draft costs a forward; a block drafter's whole block, ``b - 1``, costs one)."""

    def start(self, batch_size: int, greedy: bool = True) -> None:
        """Before the first round: the number of rows and the decoding mode."""
        self.batch_size = batch_size
        self.greedy = greedy

    def plan(self) -> list[int]:
        """The most drafts each row may propose this round."""
        return [self.max_draft] * self.batch_size

    def keep_drafting(self, step: int, probs: Tensor, tokens: Tensor, hidden: Tensor | None = None) -> Tensor:
        """[B] bool: after draft ``step`` (1-based) was sampled, which rows go on. ``probs``
        [B,V] is the draft's temperature-1 distribution the tokens [B] came from; ``hidden``
        [B,H] the draft's last hidden state that produced it (None unless
        ``uses_draft_hidden``). A policy that does not override this never stops a row
        early, and the engine then needs no host sync per draft step."""
        return torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)

    def select(self, proposal):
        """What of this round's proposal (a :class:`spec_ext.drafters.Proposal`) the target
        verifies: the proposal itself (the default), or a trimmed one (a prefix of each row's
        chain, a subtree of each row's tree holding its nodes' parents: adaptive verification,
        :class:`spec_ext.policies.Adaptive`). The drafter is told the outcome of what was verified."""
        return proposal

    def observe(self, num_draft: Sequence[int], num_accepted: Sequence[int]) -> None:
        """What the target accepted of each row's drafts this round."""

    def see_target(self, hidden: Tensor, next_tokens: Tensor) -> None:
        """(``uses_target_hidden``) After every verification and after the prefill: the
        target's last hidden state [B,H] at the last accepted token and the token [B] it
        produced, the root of the next round."""

    def see_bonus_agreement(self, agreed: Tensor) -> None:
        """(``uses_bonus_agreement``) Before ``plan()``: [B] bool per row, whether the last
        round accepted every draft and the draft agrees with the target's token after them
        (greedy: proposes it; sampling: a draw that accepts with probability sum_x min(p, q)
        at that position), i.e. whether acceptance ran on unbroken through the root."""

    def see_tree_path(self, path: Tensor) -> None:
        """(``uses_tree_paths``) After a tree round's verification (not an exploring one): the
        accepted path [B,Dmax+1] of node indices (-1 past each row's end)."""

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Only ``rows`` (indices into the current batch) go on."""
        self.batch_size = len(rows)

    @property
    def adaptive(self) -> bool:
        """Whether the policy may stop a row before its planned length (see keep_drafting)."""
        return type(self).keep_drafting is not Policy.keep_drafting

    @property
    def lookahead(self) -> int:
        """How many tokens past the committed ones a round may write to the caches."""
        return self.max_draft

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                           if not k.startswith("_") and k not in ("batch_size", "greedy"))
        return f"{type(self).__name__}({fields})"


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Make a policy class available by its lower-case name in ``policy=``."""
    POLICIES[cls.__name__.lower()] = cls
    return cls


def resolve(policy: str | Policy) -> Policy:
    """A Policy as given, or a new one (default arguments) of the class named ``policy``."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy.lower() in POLICIES:
        return POLICIES[policy.lower()]()
    raise ValueError(f"policy: expected a Policy or one of {sorted(POLICIES)}, got {policy!r}")
