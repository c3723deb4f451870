"""spec_ext: fast, exact speculative decoding for PyTorch and Hugging Face models.

``import spec_ext`` loads the kernel layer only (no transformers); the loop
(``generate``, ``accelerate``, ``SpecCache``, the policies) is imported on first use.
"""
import importlib

from spec_ext.ops import (Tree, acceptance_head, backends, build_tree, chain_rejection_sample, compact_kv,
                          greedy_verify, set_validation, skinny_linear, tree_attention, tree_greedy_verify,
                          tree_mask, tree_rejection_sample)

__version__ = "0.1.0"

# name -> module that defines it, imported when first asked for (these need transformers)
_LAZY = {"generate": "spec_ext.engine", "accelerate": "spec_ext.engine", "Output": "spec_ext.engine",
         "Stats": "spec_ext.engine", "PeerError": "spec_ext.engine", "serve_draft": "spec_ext.engine",
         "shutdown": "spec_ext.engine", "SpecCache": "spec_ext.models"}
_SUBPACKAGES = ("engine", "models", "policies", "training")

__all__ = ["Tree", "acceptance_head", "backends", "build_tree", "chain_rejection_sample", "compact_kv",
           "greedy_verify", "set_validation", "skinny_linear", "tree_attention", "tree_greedy_verify", "tree_mask",
           "tree_rejection_sample", *_LAZY, *_SUBPACKAGES]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"spec_ext.{name}")
    else:
        raise AttributeError(f"module 'spec_ext' has no attribute {name!r}")
    globals()[name] = value
    return value
