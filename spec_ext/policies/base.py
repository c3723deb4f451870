"""The decision layer's protocol, declared in one place: a :class:`Policy` (settings) starts
a :class:`Controller` per call, which plans each round (:class:`RoundPlan` from
:class:`RoundState`) and learns from its :class:`Report`; what it learns across calls lives in
a :class:`Memory` (``docs/architecture.md`` draws the round).
"""
from __future__ import annotations

import copy
import enum
import functools
import threading
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol, Sequence

import torch
from torch import Tensor


class Source(enum.IntEnum):
    """What drafts a row in a round."""
    NONE = 0   # nothing: the row's verification emits one token
    MODEL = 1  # the draft model, feature head, block drafter or MTP layers
    TEXT = 2   # the row's own prompt and output (n-gram lookup)
    CACHE = 3  # a SuffixCache of earlier requests


@dataclass(frozen=True)
class TreeShape:
    """A draft tree's shape, as data for the one grower
    (:func:`spec_ext.drafters.base.grow_tree`): static (``branching[d]`` children per node at
    depth d, the top-k of the drafter) or dynamic (EAGLE-2: ``depth`` levels of the frontier's
    ``top_k`` children by cumulative draft probability, the best ``nodes`` verified)."""
    branching: tuple[int, ...] | None = None
    depth: int = 0
    top_k: int = 0
    nodes: int = 0

    @property
    def dynamic(self) -> bool:
        return self.branching is None

    @property
    def max_depth(self) -> int:
        return self.depth if self.dynamic else len(self.branching)

    @functools.cached_property
    def parents(self) -> tuple[int, ...]:
        """A static tree's parent of every node (node 0 the root: -1), level by level."""
        return _static_layout(self.branching)[0]

    @functools.cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """A static tree's node ids at depth 1, 2, ..."""
        return _static_layout(self.branching)[1]

    @property
    def room(self) -> int:
        """The most tokens past the committed ones that growing it writes to a cache."""
        if self.dynamic:
            return max(self.nodes - 1, self.top_k * (self.depth - 1) + 1)
        return len(self.parents) - 1


def _static_layout(branching: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    parents, levels, frontier = [-1], [], [0]
    for width in branching:
        level = []
        for node in frontier:
            for _ in range(width):
                parents.append(node)
                level.append(len(parents) - 1)
        levels.append(tuple(level))
        frontier = level
    return tuple(parents), tuple(levels)


@dataclass(frozen=True)
class Offer:
    """What a row's text offers this round (:class:`TextLookup`): ``tokens`` (a chain's drafts;
    a tree's nodes with node 0 the root, token -1) and ``parents`` (None for a chain), from
    ``source`` (TEXT or CACHE), after a match of ``match`` tokens; ``probs`` each draft's
    empirical probability (node 1 on for a tree; the share of the earlier occurrences through
    it), best first where a tree is cut by them."""
    source: Source
    tokens: tuple[int, ...]
    parents: tuple[int, ...] | None = None
    match: int = 0
    probs: tuple[float, ...] = ()

    @property
    def drafts(self) -> int:
        return len(self.tokens) - (self.parents is not None)


class TextLookup(Protocol):
    """The rows' text, as the drafter keeps it in step with what the target committed
    (:class:`spec_ext.drafters.text.TextSource`); controllers ask it for offers."""

    def chain(self, row: int, most: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the row's longest matched
        suffix (at most ``most``; [] without a match)."""

    def tree(self, row: int, depth: int, nodes: int) -> Offer | None:
        """The continuations of the row's latest occurrences merged into a tree (None: no match)."""

    def cache_match(self, row: int) -> int:
        """The longest suffix of the row found in the suffix cache with a token after it (0: none)."""

    def cache_tree(self, row: int, depth: int, nodes: int) -> Offer | None:
        """The cache's tree of the row's match's most frequent continuations (None: no match)."""


@dataclass(frozen=True)
class Call:
    """What a controller knows of its call when it starts."""
    batch_size: int
    greedy: bool = True
    target: object = None  # the target model (None in unit tests)
    draft: object = None  # the module whose parameters drafting reads (None: no model drafts)
    drafts_per_forward: int = 1  # a block drafter's block: its drafts cost one forward
    forwards_without_model: int = 0  # draft forwards a round runs where the model drafts no row (MTP: 1)
    memory: "Memory | None" = None  # what earlier calls learned (accelerate's)
    time_rounds: "TimesRounds | None" = None  # (the engine's) runs a controller's rounds on random ids


class TimesRounds(Protocol):
    """The engine's timing of rounds as it runs them (:attr:`Call.time_rounds`): called with a
    controller (with ``tokens``, the most tokens its rounds emit per row, and ``done``, set once
    its last round was observed) and a batch size, it runs the controller's rounds on that many
    random prompts with the call's target, a drafter built as the call's and the call's sampling
    (its processors aside), and a random generator of its own; ``key``: the settings, past the
    models and the rows, that the rounds' cost depends on."""

    key: tuple

    def __call__(self, controller: "Controller", rows: int) -> None: ...


@dataclass
class RoundState:
    """What a controller plans a round from: ``rows`` going; the rows' ``text`` (None when no
    text source runs); ``target_hidden`` [B,H] the target's last hidden state at each row's
    root and ``roots`` [B] (only where the policy reads them: ``Policy.reads_target``);
    ``remaining`` the tokens each row may still emit (``max_new_tokens`` less its output; None:
    not known); ``behind`` the committed tokens of each row the model's drafter has not read
    (its next forward catches up over them; None: not known, or it reads them every round)."""
    rows: int
    text: TextLookup | None = None
    target_hidden: Tensor | None = None
    roots: Tensor | None = None
    remaining: list[int] | None = None
    behind: list[int] | None = None


@dataclass
class RoundPlan:
    """One round's decision, per row (B rows).

    ``k[b]``: the most drafts the model makes for row b (0: none); ``tree``: the model grows
    this tree for every row instead (where set); ``text[b]``: the text drafts row b verifies
    instead of the model's (an :class:`Offer`, cut), or None. A round with no model drafts
    and no text is a plain decode step. The plan is also the round's record: ``record`` is the
    controller's own (what it priced), handed back in :attr:`Report.plan`."""
    k: list[int]
    text: list[Offer | None] | None = None
    tree: TreeShape | None = None
    stop: Callable | None = None  # (step, probs [B,V], tokens [B], hidden [B,H] | None) -> [B] bool
    trim: Callable | None = None  # (proposal) -> proposal
    after_catch_up: Callable | None = None  # (agreement [B] bool) -> k
    steps: int = 1  # (a plain plan) plain steps before the next plan; fewer where a row finishes first, one
    # in the call's first round and beside a drafter that runs every round (MTP)
    record: object = None

    def __post_init__(self):
        if self.text is None:
            self.text = [None] * len(self.k)
        if self.steps < 1:
            raise ValueError(f"steps: must be >= 1, got {self.steps}")

    @property
    def rows(self) -> int:
        return len(self.k)

    @property
    def model_runs(self) -> bool:
        """Whether the model drafts some row (else it waits or catches up only)."""
        return self.tree is not None or any(self.k)

    @property
    def plain(self) -> bool:
        """Nothing drafts: a plain decode step."""
        return not self.model_runs and not any(self.text)

    @property
    def sources(self) -> list[Source]:
        model = Source.MODEL if self.tree is not None else None
        return [t.source if t is not None else model or (Source.MODEL if k else Source.NONE)
                for t, k in zip(self.text, self.k)]

    @property
    def reads_agreement(self) -> bool:
        return self.after_catch_up is not None

    def budget(self, agreement: Tensor | None = None) -> list[int]:
        """The chain length of every row, called once the drafter caught up (``agreement``
        [B] bool: where ``reads_agreement``, whether the drafter agreed with the last round's
        bonus token after accepting every draft)."""
        return self.k if self.after_catch_up is None else self.after_catch_up(agreement)

    def slots(self, most: int | None = None) -> tuple[int, list[int] | None]:
        """For a drafter whose one forward makes every draft (a block drafter, P-EAGLE): how
        many (a tree's depth; a chain's longest budget) and a chain's budget, each row's at
        most ``most`` (None for a tree)."""
        if self.tree is not None:
            return self.tree.max_depth, None
        budget = [k if most is None else min(k, most) for k in self.budget()]
        return max(budget), budget

    @property
    def stops(self) -> bool:
        """Whether :meth:`keep_drafting` may stop a row (each draft step then syncs the host)."""
        return self.stop is not None

    def keep_drafting(self, step: int, probs: Tensor, tokens: Tensor, hidden: Tensor | None = None) -> Tensor:
        """[B] bool: after draft ``step`` (1-based) was sampled, which rows go on. ``probs``
        [B,V] is the draft's temperature-1 distribution the tokens [B] came from; ``hidden``
        [B,H] the draft's last hidden state (None unless the policy ``reads_draft_hidden``)."""
        if self.stop is None:
            return torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
        return self.stop(step, probs, tokens, hidden)

    def select(self, proposal):
        """What of ``proposal`` (a :class:`spec_ext.drafters.Proposal`) the target verifies:
        itself, or a prefix (subtree) per row."""
        return proposal if self.trim is None else self.trim(proposal)


@dataclass
class Report:
    """What a round gave, per row (the rows of the round's plan).

    ``source``: what drafted each row; ``drafted``, ``accepted``: its verified drafts and how
    many were accepted; ``committed``: the tokens the target committed (accepted drafts and
    one more); ``width``: tokens verified per row, the root included; ``seconds``: the round,
    from its plan to its commit; ``verify_seconds``: of that, from the selection on (the
    target's forward, the sampler, the commit); ``draft_seconds`` and ``draft_forwards``: the
    model's forwards, ``draft_steps`` the drafts they computed (a chain's steps, a block's
    slots, a tree's depth); ``warm``: those forwards are a draft step's cost (not a catch-up over
    the prompt or skipped rounds); ``path`` [B,D+1]: a tree's accepted node ids; ``explores``:
    the drafter tried another way only to measure it (nothing is learned from the round);
    ``timed`` False: the round's seconds are not a round's cost (the call's first, whose
    forward also read the prompt); ``steps``: the plain steps a plain plan's report covers
    (``committed`` holds all their tokens; the seconds are their mean)."""
    plan: RoundPlan
    source: list[Source]
    drafted: list[int]
    accepted: list[int]
    committed: list[list[int]]
    width: int
    seconds: float = 0.0
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0
    draft_forwards: int = 0
    draft_steps: int = 0
    warm: bool = True
    path: Tensor | None = None
    explores: bool = False
    timed: bool = True
    steps: int = 1


class Memory:
    """What a policy learned across calls: named entries, each read as a copy at a call's
    start and merged back at its end under one lock. An entry nobody wrote since the call
    read it is replaced by the call's (so consecutive calls go on from the last one, as one
    long call would); one another call wrote meanwhile is merged with it (the entry's
    ``merged(other)``), so concurrent calls both contribute."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict = {}  # key -> (value, version)

    def read(self, key) -> tuple[object, int]:
        """(a copy of the entry ``key``, or None; its version)."""
        with self._lock:
            value, version = self._entries.get(key, (None, 0))
            return copy.deepcopy(value), version

    def write(self, key, value, version: int) -> None:
        """Put the call's ``value`` for ``key``, read at ``version``."""
        with self._lock:
            current, now = self._entries.get(key, (None, 0))
            if current is not None and now != version:
                value = current.merged(value)
            self._entries[key] = (value, now + 1)

    def keys(self) -> list:
        with self._lock:
            return list(self._entries)


class Controller:
    """One call's decisions (the default: the policy's tree for every row, else its
    ``max_draft`` drafts, each row stopped where the policy's ``goes_on`` says)."""

    per_row: ClassVar[tuple[str, ...]] = ()  # the names of lists with an entry per row going

    def __init__(self, policy: "Policy", call: Call):
        self.policy, self.call = policy, call
        self.rows = call.batch_size
        self._recalled: dict = {}  # name -> (the value read from call.memory, its version)

    def plan(self, state: RoundState) -> RoundPlan:
        tree = self.policy.tree_shape()
        k = 0 if tree is not None else self.policy.max_draft
        return RoundPlan([k] * state.rows, tree=tree, stop=self.policy.goes_on)

    def observe(self, report: Report) -> None:
        """What the round gave (after the verification)."""

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Only ``rows`` (indices into the current batch) go on: the lists named in ``per_row`` keep theirs."""
        self.rows = len(rows)
        for name in self.per_row:
            setattr(self, name, [getattr(self, name)[r] for r in rows])

    def recall(self, **fresh: Callable[[], object]) -> list:
        """Per keyword its entry of ``call.memory`` (a copy; greedy calls only: a sampled call
        reads none, so that its seed alone decides its output), else ``fresh[name]()``; in
        that order. :meth:`finish` writes these objects back as the call changed them."""
        memory = self.call.memory if self.call.greedy else None
        for name, make in fresh.items():
            value, version = memory.read(name) if memory is not None else (None, 0)
            self._recalled[name] = (make() if value is None else value), version
        return [self._recalled[name][0] for name in fresh]

    def finish(self) -> None:
        """The call is over: what it recalled goes back to ``call.memory`` (merged with what
        other calls wrote since it read)."""
        memory = self.call.memory if self.call.greedy else None
        if memory is not None:
            for name, (value, version) in self._recalled.items():
                memory.write(name, value, version)


@dataclass(frozen=True)
class Policy:
    """Base class of every policy: settings (frozen), and :meth:`start`, which makes the call's
    :class:`Controller`. Its class attributes say what it needs of the engine and the drafters,
    so that none asks which class it is."""
    parallel: ClassVar[bool] = False  # the parallel engine runs it (PEARL, SpecBranch)
    reads_target: ClassVar[bool] = False  # RoundState holds the target's last hidden state at each root
    reads_draft_hidden: ClassVar[bool] = False  # the drafter hands its hidden state to the plan's stop
    reads_agreement: ClassVar[bool] = False  # the drafter's bonus agreement (RoundPlan.after_catch_up)
    needs_model: ClassVar[bool] = True  # without text it drafts with a model (NGram and Suffix do not)
    drafts: ClassVar[bool] = True  # False: it drafts nothing (Plain), a draft given is not used
    # a method (step, probs [B,V], tokens [B], hidden [B,H] | None) -> [B] bool: which rows of a chain draft on
    goes_on: ClassVar[Callable | None] = None

    @property
    def max_draft(self) -> int:
        """The most drafts (tree nodes) a round proposes per row."""
        return 5

    @property
    def lookahead(self) -> int:
        """How many tokens past the committed ones a round may write to the caches."""
        return self.max_draft

    @property
    def drafts_elsewhere(self) -> bool:
        """The draft runs in another process (the call is given none)."""
        return False

    def text_settings(self, has_model: bool):
        """The text source's settings (:class:`spec_ext.policies.ngram.TextSettings`) for a
        call with (``has_model``) or without a model, or None: no text source."""
        return None

    def tree_shape(self) -> TreeShape | None:
        """The tree the model grows every round (None: chains)."""
        return None

    def fitted(self, max_depth: int | None, chain: int | None, drafter: str = "the drafter") -> "Policy":
        """This policy for ``drafter`` (its description, for errors), which drafts at most
        ``max_depth`` in a line (None: any) and a ``chain`` of drafts where the policy names
        no length (None: the policy's default): itself, or a copy whose numbers left unset
        (None) fit it. A number set beyond ``max_depth`` raises ValueError naming the policy."""
        shape = self.tree_shape()
        if shape is not None and max_depth is not None and shape.max_depth > max_depth:
            raise ValueError(f"policy: {self!r} grows trees {shape.max_depth} deep; {drafter} drafts at most "
                             f"{max_depth} in a line")
        return self

    def start(self, call: Call) -> Controller:
        """The call's controller. Raises ``ValueError`` for a tree with a per-step stop
        (``goes_on`` stops chains)."""
        if self.goes_on is not None and self.tree_shape() is not None:
            raise ValueError(f"policy: {self!r} grows a tree and stops per draft step (goes_on), which only a "
                             f"chain can: give it one of the two")
        return Controller(self, call)


POLICIES: dict[str, type[Policy]] = {}


def renumbered(parents: Sequence[int], order: Sequence[int]) -> list[int]:
    """The parents of a tree cut to its root and the nodes ``order`` (each one's parent among
    them or the root), numbered 1.. in that order; the root's -1."""
    new = {0: 0}
    for i, old in enumerate(order, start=1):
        new[old] = i
    return [-1] + [new[parents[i]] for i in order]


def node_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth in a tree of ``parents`` (parents before children; the root's 0)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


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


def check(condition: bool, names: str, message: str) -> None:
    """ValueError naming ``names`` unless ``condition``."""
    if not condition:
        raise ValueError(f"{names}: {message}")

