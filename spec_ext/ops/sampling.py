"""Verification of drafts: chain and tree, greedy and by (multi-draft recursive) rejection
sampling, exact for every backend; ``spec_ext.reference`` is the specification."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from spec_ext.ops import registry
from spec_ext.ops.checks import check_distributions, check_ids, check_parents, check_shape, check_tensor, fail
from spec_ext.ops.trees import tree_mask


class ChainResult(NamedTuple):
    tokens: Tensor        # [B,K+1] emitted tokens (accepted drafts, then one more), -1 padded
    num_accepted: Tensor  # [B]


class TreeResult(NamedTuple):
    path: Tensor          # [B,Dmax+1] accepted node ids from the root (0), -1 padded
    tokens: Tensor        # [B,Dmax+1] emitted tokens, -1 padded
    num_accepted: Tensor  # [B]


def _upcast(logits):
    """Half-precision logits as float32 (the kernels read float32; argmax is unchanged)."""
    if isinstance(logits, Tensor) and logits.dtype in (torch.float16, torch.bfloat16):
        return logits.float()
    return logits


def _check_logits(name: str, logits: Tensor) -> None:
    """Logits may mask tokens with -inf (HF's processors, grammars, bad words do); NaN, +inf and
    a row masked entirely (nothing left to emit) are refused."""
    if bool(torch.isnan(logits).any()):
        fail(name, "contains NaN")
    if bool((logits == float("inf")).any()):
        fail(name, "contains +inf")
    if logits.shape[-1] and bool((logits == float("-inf")).all(-1).any()):
        fail(name, "has a row masked entirely (every entry -inf: no token left to emit)")


def _chain_args(name: str, target: Tensor, draft_tokens: Tensor, num_draft: Tensor | None, check: bool) -> Tensor:
    if check:
        check_tensor(name, target, 3, (torch.float32,))
    B, K1, V = target.shape
    if num_draft is None:
        num_draft = torch.full((B,), K1 - 1, dtype=torch.int64, device=target.device)
    if check:
        check_tensor("draft_tokens", draft_tokens, 2, (torch.int64,), target.device)
        check_shape("draft_tokens", draft_tokens, (B, K1 - 1))
        check_tensor("num_draft", num_draft, 1, (torch.int64,), target.device)
        check_shape("num_draft", num_draft, (B,))
        if bool(((num_draft < 0) | (num_draft > K1 - 1)).any()):
            fail("num_draft", f"every entry must be in [0, K={K1 - 1}]")
        check_ids("draft_tokens", draft_tokens, V)
    return num_draft


def _uniforms(uniforms: Tensor | None, shape: tuple[int, int], device, generator, check: bool) -> Tensor:
    if uniforms is None:
        return torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    if check:
        check_tensor("uniforms", uniforms, 2, (torch.float64,), device)
        check_shape("uniforms", uniforms, shape)
    return uniforms


def chain_rejection_sample(target_probs: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None = None,
                           num_draft: Tensor | None = None, uniforms: Tensor | None = None,
                           generator: torch.Generator | None = None, backend: str = "auto",
                           validate: bool | None = None) -> ChainResult:
    """Verify a padded batch of draft chains by rejection sampling (exact: the emitted
    tokens follow the target distribution).

    Args:
        target_probs: [B,K+1,V] float32; row i is p after the prefix and drafts < i. A masked
            token has probability 0; refused: NaN, inf, negative entries, a row summing to 0
            (masked entirely) or not to 1 (the same for ``draft_probs``).
        draft_tokens: [B,K] int64; -1 (or positions >= num_draft) means no draft.
        draft_probs: [B,K,V] float32, the q each draft was sampled from; None for
            deterministic drafts (one-hot q).
        num_draft: [B] int64 drafts per row (default K).
        uniforms: [B,K+1] float64 coins: column j for draft j, the last for the final
            (residual or bonus) draw by inverse CDF. Drawn with ``generator`` when None.
        backend: "auto", "torch", "cpu", "cuda", "triton", or "triton_split" (each row's
            vocabulary split across programs, for small batches on a GPU; not yet run on
            a GPU, so "auto" never picks it). The same for :func:`greedy_verify`.
    Returns:
        ChainResult(tokens [B,K+1] -1 padded, num_accepted [B]); row b emits
        ``tokens[b, :num_accepted[b] + 1]``.

    Example:
        >>> p = torch.softmax(torch.randn(2, 4, 16), -1)
        >>> q = torch.softmax(torch.randn(2, 3, 16), -1)
        >>> drafts = torch.multinomial(q.view(-1, 16), 1).view(2, 3)
        >>> tokens, num_accepted = chain_rejection_sample(p, drafts, q)
    """
    check = registry.checking(validate)
    num_draft = _chain_args("target_probs", target_probs, draft_tokens, num_draft, check)
    B, K1, V = target_probs.shape
    if check and draft_probs is not None:
        check_tensor("draft_probs", draft_probs, 3, (torch.float32,), target_probs.device)
        check_shape("draft_probs", draft_probs, (B, K1 - 1, V))
    uniforms = _uniforms(uniforms, (B, K1), target_probs.device, generator, check)
    if check:
        positions = torch.arange(K1, device=target_probs.device)
        check_distributions("target_probs", target_probs, positions <= num_draft[:, None])
        if draft_probs is not None:
            check_distributions("draft_probs", draft_probs, positions[:-1] < num_draft[:, None])
    verify = registry.kernel("chain_verify", backend, target_probs.device)
    return ChainResult(*verify(target_probs, draft_tokens, draft_probs, num_draft, uniforms, False))


def greedy_verify(target_logits: Tensor, draft_tokens: Tensor, num_draft: Tensor | None = None,
                  backend: str = "auto", validate: bool | None = None) -> ChainResult:
    """Greedy verification: accept drafts while they equal the target's argmax (first
    index on ties), then emit the argmax. Shapes as :func:`chain_rejection_sample`;
    ``target_logits`` [B,K+1,V] may be logits or probabilities (float32, float16, bfloat16);
    logits may mask tokens with -inf (refused: NaN, +inf, a row masked entirely).

    Example:
        >>> logits = torch.randn(1, 3, 10)
        >>> greedy_verify(logits, logits[:, :2].argmax(-1)).num_accepted.tolist()
        [2]
    """
    target_logits, check = _upcast(target_logits), registry.checking(validate)
    num_draft = _chain_args("target_logits", target_logits, draft_tokens, num_draft, check)
    if check:
        _check_logits("target_logits", target_logits)
    verify = registry.kernel("chain_verify", backend, target_logits.device)
    return ChainResult(*verify(target_logits, draft_tokens, None, num_draft, None, True))


def _tree_args(name: str, target: Tensor, tree_tokens: Tensor, parents: Tensor, check: bool) -> Tensor:
    if check:
        check_tensor(name, target, 3, (torch.float32,))
    B, T = target.shape[:2]
    if check:
        check_tensor("tree_tokens", tree_tokens, 2, (torch.int64,), target.device)
        check_shape("tree_tokens", tree_tokens, (B, T))
        check_tensor("parents", parents, (1, 2), (torch.int64,), target.device)
        if parents.shape[-1] != T or (parents.dim() == 2 and parents.shape[0] not in (1, B)):
            fail("parents", f"expected [T={T}], [1, T] or [B={B}, T], got {tuple(parents.shape)}")
    parents = parents.expand(B, T)
    if check:
        check_parents(parents)
        check_ids("tree_tokens", tree_tokens[:, 1:], target.shape[2])
    return parents.contiguous()


def tree_rejection_sample(target_probs: Tensor, tree_tokens: Tensor, parents: Tensor,
                          draft_probs: Tensor | None = None, siblings: str = "without_replacement",
                          uniforms: Tensor | None = None, generator: torch.Generator | None = None,
                          max_depth: int | None = None, backend: str = "auto",
                          validate: bool | None = None) -> TreeResult:
    """Verify a batch of draft trees by multi-draft recursive rejection sampling (exact).

    Args:
        target_probs: [B,T,V] float32; row i is p after node i (node 0 is the root, the
            last committed token). Masked tokens are 0; refused as in :func:`chain_rejection_sample`.
        tree_tokens: [B,T] int64 node tokens (the root's is ignored; -1 marks an absent node).
        parents: [T], [1,T] or [B,T] int64; ``parents[0] == -1``, ``parents[i] < i``.
        draft_probs: [B,T,V] float32: q that node i's children were sampled from; None
            for deterministic drafts (e.g. top-k children).
        siblings: ``"without_replacement"`` (children drawn without replacement from q;
            each rejected one is removed from q) or ``"iid"`` (q unchanged).
        uniforms: [B,T+1] float64: column i is node i's coin, the last the final draw.
        max_depth: the trees' greatest depth (Dmax) when the caller knows it (e.g. a
            static tree); otherwise computed from ``parents`` (one more launch and a sync).
        backend: as :func:`chain_rejection_sample`; "triton_split" here keeps no float64
            workspace (opt-in, not yet run on a GPU).
    Returns:
        TreeResult(path [B,Dmax+1], tokens [B,Dmax+1], num_accepted [B]), -1 padded.

    Example:
        >>> parents = torch.tensor([-1, 0, 0, 1])
        >>> p = torch.softmax(torch.randn(1, 4, 8), -1)
        >>> result = tree_rejection_sample(p, torch.tensor([[5, 1, 2, 3]]), parents)
    """
    if siblings not in ("without_replacement", "iid"):
        raise ValueError(f"siblings: expected 'without_replacement' or 'iid', got {siblings!r}")
    check = registry.checking(validate)
    parents = _tree_args("target_probs", target_probs, tree_tokens, parents, check)
    B, T, V = target_probs.shape
    if check and draft_probs is not None:
        check_tensor("draft_probs", draft_probs, 3, (torch.float32,), target_probs.device)
        check_shape("draft_probs", draft_probs, (B, T, V))
    uniforms = _uniforms(uniforms, (B, T + 1), target_probs.device, generator, check)
    if check:
        check_distributions("target_probs", target_probs)
        if draft_probs is not None:
            has_children = torch.zeros(B, T, dtype=torch.bool, device=target_probs.device)
            has_children.scatter_(1, parents[:, 1:].clamp_min(0), tree_tokens[:, 1:] >= 0)
            check_distributions("draft_probs", draft_probs, has_children)
    return _call_tree(backend, target_probs, tree_tokens, parents, draft_probs, uniforms, False,
                      siblings == "without_replacement", max_depth, check)


def tree_greedy_verify(target_logits: Tensor, tree_tokens: Tensor, parents: Tensor, max_depth: int | None = None,
                       backend: str = "auto", validate: bool | None = None) -> TreeResult:
    """Greedy tree verification: from the root, follow the first child whose token is the
    target's argmax; emit the argmax where none is. Shapes as :func:`tree_rejection_sample`;
    ``target_logits`` as :func:`greedy_verify`'s (-inf entries allowed); ``backend="triton_split"`` finds every node's argmax split over the vocabulary (opt-in,
    not yet run on a GPU)."""
    target_logits, check = _upcast(target_logits), registry.checking(validate)
    parents = _tree_args("target_logits", target_logits, tree_tokens, parents, check)
    if check:
        _check_logits("target_logits", target_logits)
    return _call_tree(backend, target_logits, tree_tokens, parents, None, None, True, True, max_depth, check)


def _call_tree(backend, target, tree_tokens, parents, draft_probs, uniforms, greedy, without_replacement,
               max_depth, check) -> TreeResult:
    verify = registry.kernel("tree_verify", backend, target.device)
    out = verify(target, tree_tokens, parents, draft_probs, uniforms, greedy, without_replacement)
    if max_depth is None:
        max_depth = int(tree_mask(parents, validate=False)[0].max())
    elif check and bool((out[0][:, max_depth + 1:] >= 0).any()):
        fail("max_depth", f"{max_depth} is less than the depth of an accepted path")
    width = max_depth + 1
    return TreeResult(out[0][:, :width], out[1][:, :width], out[2])
