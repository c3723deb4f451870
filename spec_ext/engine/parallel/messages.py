"""The messages between the two sides of a parallel run (picklable: they also cross processes)."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from spec_ext.policies import BranchHint


@dataclass
class Start:
    prompts: list[list[int]]
    sampling: dict       # the sampler's warper settings (Sampler.settings)
    seed: int
    capacity: int
    lookahead: int
    branches: int         # most lanes (branches) per row; 1 = a chain (PEARL)
    fast_linear: bool | str  # the draft's linear layers take ops.skinny_linear (lean.prepare)
    vocab_size: int       # the target's V: the draft's q comes padded (or truncated) to it


@dataclass
class Hello:
    """The draft side's answer to Start: it checked its model and is ready."""


@dataclass
class Drafts:
    """One draft step: node ``nodes[i]`` of row ``rows[i]`` holds ``tokens[i]``, a child of
    node ``parents[i]`` (-1: the row's current root), drawn from ``q[i]`` (sampling)."""
    rows: list[int]
    epochs: list[int]
    nodes: list[int]
    parents: list[int]
    tokens: list[int]
    q: Tensor | None
    seconds: float        # the draft step's wall time


@dataclass
class Verdict:
    committed: dict[int, int]                                     # row -> committed length
    moves: dict[int, int] = field(default_factory=dict)           # row -> accepted node that is the new root
    resets: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # row -> (epoch, last accepted node, token)
    finished: list[int] = field(default_factory=list)
    hints: dict[int, BranchHint] = field(default_factory=dict)    # row -> where to branch next



@dataclass
class End:
    pass


@dataclass
class Done:
    draft_calls: int


@dataclass
class Shutdown:
    pass


@dataclass
class Failure:
    error: str


class PeerError(RuntimeError):
    """The other side of a parallel run died, failed or stalled."""
