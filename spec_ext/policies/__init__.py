"""Policies: how the draft proposes each round, behind one protocol (:class:`Policy`).

| policy | what it does |
|---|---|
| ``Auto()`` (default) | picks k before each round from the acceptance and round costs it measures |
| ``Adaptive()`` | adaptive verification: each row verifies the prefix (subtree) of its drafts worth its measured cost |
| ``Fixed(k=5)`` | always k drafts (vanilla speculative decoding) |
| ``Heuristic()`` | HF assisted generation's schedule: +2 after a round that accepted all, else -1 |
| ``Confidence()`` | HF assisted generation's default: stop below draft probability 0.4 |
| ``SVIP()`` | stop when sqrt(c * H(q)) > h (c=0.15, h=0.3) |
| ``SpecDecPP()`` | learned acceptance head on the draft's hidden state |
| ``AdaLength()`` | learned length predictor on the target's hidden state (AdaEAGLE) |
| ``Tree()`` | a static top-k draft tree verified with tree attention |
| ``DynamicTree()`` | EAGLE-2's tree, grown by the draft's cumulative probability |
| ``NGram()`` | prompt lookup: drafts from the row's own text, no draft model (chains or trees) |
| ``Suffix(cache)`` | suffix decoding: NGram plus a ``SuffixCache`` of earlier requests' texts (trees) |
| ``PEARL()`` | draft and target at the same time (parallel engine) |
| ``SpecBranch()``, ``LearnedSpecBranch()`` | PEARL plus branches at uncertain points |
"""
from spec_ext.policies.base import POLICIES, Policy, register, resolve
from spec_ext.policies.rules import SVIP, Auto, Confidence, Fixed, Heuristic
from spec_ext.policies.tree import DynamicTree, Tree
from spec_ext.policies.adaptive import Adaptive
from spec_ext.policies.step_costs import StepCosts
from spec_ext.policies.ngram import NGram, NGramIndex, continuation_tree, reference_occurrences
from spec_ext.policies.suffix import Suffix, SuffixCache, reference_tree
from spec_ext.policies.parallel import PEARL, BranchHint, SpecBranch
from spec_ext.policies.learned import (AdaLength, BranchPredictor, LearnedSpecBranch, ResidualMLP, SpecDecPP,
                                       draft_features, history_features)

__all__ = ["POLICIES", "SVIP", "AdaLength", "Adaptive", "Auto", "BranchHint", "BranchPredictor", "Confidence",
           "DynamicTree", "Fixed", "Heuristic", "LearnedSpecBranch", "NGram", "NGramIndex", "PEARL", "Policy",
           "ResidualMLP", "SpecBranch", "SpecDecPP", "StepCosts", "Suffix", "SuffixCache", "Tree", "continuation_tree",
           "draft_features", "history_features", "reference_occurrences", "reference_tree", "register", "resolve"]
