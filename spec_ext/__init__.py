"""spec_ext: fast, exact speculative decoding for PyTorch and Hugging Face models."""
from spec_ext.ops import (backends, chain_rejection_sample, compact_kv, greedy_verify, set_validation,
                          tree_attention, tree_greedy_verify, tree_mask, tree_rejection_sample)
from spec_ext.tree import Tree, build_tree
from spec_ext.cache import SpecCache
from spec_ext.decoding import Output, Stats, accelerate, generate
from spec_ext import learned, parallel, policies

__version__ = "0.1.0"
__all__ = ["accelerate", "generate", "Output", "Stats", "SpecCache", "learned", "parallel", "policies", "backends",
           "build_tree", "chain_rejection_sample", "compact_kv", "greedy_verify", "set_validation", "Tree",
           "tree_attention", "tree_greedy_verify", "tree_mask", "tree_rejection_sample"]
