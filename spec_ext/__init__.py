"""spec_ext: fast, exact speculative decoding for PyTorch and Hugging Face models.

``import spec_ext`` loads nothing heavy: the kernel API (``spec_ext.tree_attention`` ...)
loads torch and the compiled kernels on first use, the loop (``generate``, ``accelerate``,
``SpecCache``, the policies) also transformers.
"""
import importlib

__version__ = "0.1.0"

_KERNELS = ("Tree", "acceptance_head", "backends", "build_tree", "chain_rejection_sample", "compact_kv",
            "greedy_verify", "set_validation", "skinny_linear", "tree_attention", "tree_greedy_verify", "tree_mask",
            "tree_rejection_sample")
# name -> module that defines it, imported when first asked for (the kernel API loads torch
# and the extension; the rest also transformers)
_LAZY = {name: "spec_ext.ops" for name in _KERNELS}
_LAZY |= {name: "spec_ext.engine" for name in ("generate", "accelerate", "Output", "Stats", "PeerError", "serve_draft",
                                               "shutdown")}
_LAZY["SpecCache"] = "spec_ext.models"
_LAZY["SuffixCache"] = "spec_ext.policies"
_LAZY["Grammar"] = "spec_ext.processing"
_SUBPACKAGES = ("drafters", "engine", "models", "ops", "policies", "processing", "training")

__all__ = [*_LAZY, *_SUBPACKAGES]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"spec_ext.{name}")
    else:
        raise AttributeError(f"module 'spec_ext' has no attribute {name!r}")
    globals()[name] = value
    return value
