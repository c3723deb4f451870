"""Policies: what drafts each row every round and how far, behind one protocol
(:mod:`spec_ext.policies.base`): a policy is settings (a frozen value, shared by calls and
threads); ``policy.start(call)`` makes the call's controller, whose ``plan(state)`` and
``observe(report)`` decide and learn round by round.

The policies and when to use each: README.md (Policies); numbers left unset fit the drafter
(:meth:`Policy.fitted`).
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
