"""Policies: what drafts each row every round and how far, behind one protocol
(:mod:`spec_ext.policies.base`): a policy is settings (a frozen value, shared by calls and
threads); ``policy.start(call)`` makes the call's controller, whose ``plan(state)`` and
``observe(report)`` decide and learn round by round.

| policy | what it does |
|---|---|
| ``Plain()`` | no drafts: one target forward per token (spec_ext's decoding without speculation) |
| ``Auto()`` (default) | per row: the model, the row's own text or nothing, and k, from measured acceptance and costs |
| ``Adaptive()`` | adaptive verification: each row verifies the prefix (subtree) of its drafts worth its measured cost |
| ``Fixed()`` | always k drafts (vanilla speculative decoding; default 5, a block's slots, the MTP layers) |
| ``Heuristic()`` | HF assisted generation's schedule: +2 after a round that accepted all, else -1 |
| ``Confidence()`` | HF assisted generation's default: stop below draft probability 0.4 |
| ``SVIP()`` | stop when sqrt(c * H(q)) > h (c=0.15, h=0.3) |
| ``SpecDecPP()`` | learned acceptance head on the draft's hidden state |
| ``AdaLength()`` | learned length predictor on the target's hidden state (AdaEAGLE) |
| ``Tree()`` | a static top-k draft tree verified with tree attention (default (3, 2, 1, 1)) |
| ``DynamicTree()`` | EAGLE-2's tree, grown by the draft's cumulative probability (default 6 deep) |
| ``NGram()`` | prompt lookup: drafts from the row's own text, no draft model (chains or trees) |
| ``Suffix(cache)`` | suffix decoding: NGram plus a ``SuffixCache`` of earlier requests' texts (trees) |
| ``PEARL()`` | draft and target at the same time (parallel engine) |
| ``SpecBranch()``, ``LearnedSpecBranch()`` | PEARL plus branches at uncertain points |

Numbers left unset fit the drafter (:meth:`Policy.fitted`): a block drafter of b slots drafts
at most b - 1 in a line, so ``Tree()`` and ``DynamicTree()`` grow no deeper; a number set
beyond what the drafter drafts is refused, naming the policy.
"""
from spec_ext.policies.base import (POLICIES, Call, Controller, Memory, Offer, Policy, Report, RoundPlan, RoundState,
                                    Source, TextLookup, TreeShape, register, resolve)
from spec_ext.policies.estimates import Acceptance, Costs, Pricing, calibrate
from spec_ext.policies.rules import SVIP, Confidence, Fixed, Heuristic, Plain
from spec_ext.policies.tree import DynamicTree, Tree
from spec_ext.policies.ngram import NGram, NGramIndex, TextSettings, continuation_tree
from spec_ext.policies.auto import Auto
from spec_ext.policies.adaptive import Adaptive
from spec_ext.policies.suffix import Suffix, SuffixCache
from spec_ext.policies.parallel import PEARL, BranchHint, SpecBranch
from spec_ext.policies.learned import (AdaLength, BranchPredictor, LearnedSpecBranch, ResidualMLP, SpecDecPP,
                                       draft_features, history_features)

__all__ = ["POLICIES", "SVIP", "Acceptance", "AdaLength", "Adaptive", "Auto", "BranchHint", "BranchPredictor",
           "Call", "Confidence", "Controller", "Costs", "DynamicTree", "Fixed", "Heuristic", "LearnedSpecBranch",
           "Memory", "NGram", "NGramIndex", "Offer", "PEARL", "Plain", "Policy", "Pricing", "Report",
           "ResidualMLP", "RoundPlan", "RoundState", "Source", "SpecBranch", "SpecDecPP", "Suffix", "SuffixCache",
           "TextLookup", "TextSettings", "Tree", "TreeShape", "calibrate", "continuation_tree", "draft_features",
           "history_features", "register", "resolve"]
