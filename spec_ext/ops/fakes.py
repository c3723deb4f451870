"""Fake (meta) implementations of the compiled ops, so they trace under torch.compile."""
from __future__ import annotations

import torch

from spec_ext.ops.registry import _C_ERROR

if _C_ERROR is None:
    @torch.library.register_fake("spec_ext::tree_mask")
    def _(parents):
        B, T = parents.shape
        return parents.new_empty(B, T), parents.new_empty(B, T, (T + 31) // 32, dtype=torch.int32)

    @torch.library.register_fake("spec_ext::chain_verify")
    def _(target, draft_tokens, draft_probs, num_draft, uniforms, greedy):
        B, K1, _ = target.shape
        return draft_tokens.new_empty(B, K1), draft_tokens.new_empty(B)

    @torch.library.register_fake("spec_ext::tree_verify")
    def _(target, tree_tokens, parents, draft_probs, uniforms, greedy, without_replacement):
        B, T, _ = target.shape
        return tree_tokens.new_empty(B, T), tree_tokens.new_empty(B, T), tree_tokens.new_empty(B)

    @torch.library.register_fake("spec_ext::tree_attention")
    def _(q, k, v, prefix_lens, tree_mask, scale, window, softcap, sinks):
        return q.new_empty(*q.shape[:3], v.shape[3])

    @torch.library.register_fake("spec_ext::tree_attention_invariant")
    def _(q, k, v, prefix_lens, tree_mask, scale, window, softcap, sinks):
        return q.new_empty(*q.shape[:3], v.shape[3])

    @torch.library.register_fake("spec_ext::compact_kv")
    def _(caches, src, dst_start):
        return None

    @torch.library.register_fake("spec_ext::skinny_linear")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("spec_ext::acceptance_head")
    def _(hidden, probs, weights, column, eps):
        return probs.new_empty(probs.shape[0])
