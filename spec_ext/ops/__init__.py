"""The kernel layer: validate arguments, pick a backend, call it. Importable without
transformers (``import spec_ext.ops`` loads torch and the compiled extension only).

Every op takes ``backend="auto"|"torch"|"cpu"|"triton"|"cuda"`` (those it has) and
``validate=None|True|False``. Checks (shapes, dtypes, devices, and the ones that sync with
the host: NaN scans, id ranges) are on by default; ``validate=False`` skips all of them,
the one way to call an op unchecked (hot loops, CUDA graphs); ``set_validation(False)``
makes that the default for every call.
"""
from spec_ext.ops.registry import BACKENDS, OPS, backends, explain, registered, set_validation
from spec_ext.ops.trees import Tree, build_tree, tree_mask
from spec_ext.ops.sampling import (ChainResult, TreeResult, chain_rejection_sample, greedy_verify,
                                   tree_greedy_verify, tree_rejection_sample)
from spec_ext.ops.attention import invariant_attention, tree_attention
from spec_ext.ops.kv_cache import compact_kv
from spec_ext.ops.linear import SKINNY_ROWS, invariant_linear, skinny_linear
from spec_ext.ops.acceptance_head import acceptance_head
from spec_ext.ops import fakes  # noqa: F401  (registers the fake implementations)

__all__ = ["BACKENDS", "OPS", "SKINNY_ROWS", "ChainResult", "Tree", "TreeResult", "acceptance_head", "backends",
           "build_tree", "chain_rejection_sample", "compact_kv", "explain", "greedy_verify", "invariant_attention",
           "invariant_linear", "registered", "set_validation", "skinny_linear", "tree_attention", "tree_greedy_verify",
           "tree_mask", "tree_rejection_sample"]
