"""Public kernel API: validate arguments, pick a backend, call it.

Backends: ``torch`` (spec_ext.reference), ``cpu`` (C++, spec_ext._C), ``cuda`` (CUDA,
spec_ext._C), ``triton`` (spec_ext.kernels). ``backend="auto"`` picks cuda > triton >
torch for CUDA tensors and cpu > torch for CPU tensors. Validation that needs a host
sync (NaN scans, id ranges) is on by default; switch it off per call (``validate=False``)
or globally (``set_validation(False)``) for CUDA graphs and hot loops.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext import reference

BACKENDS = ("torch", "cpu", "triton", "cuda")
OPS = ("tree_mask", "chain_verify", "tree_verify", "tree_attention", "compact_kv", "skinny_linear",
       "acceptance_head")
# dispatch keys each op has compiled kernels for, in a build with CUDA (skinny_linear: CPU
# only; on a GPU cuBLAS already reads skinny operands at full bandwidth; acceptance_head:
# CPU only, it fuses away per-op host overhead that a GPU hides behind its queue)
KERNEL_KEYS = {op: ("CPU", "CUDA") for op in OPS} | {"skinny_linear": ("CPU",), "acceptance_head": ("CPU",)}

try:
    from spec_ext import _C  # noqa: F401  (registers the spec_ext:: kernels)
    _C_ERROR = None
except ImportError as error:  # pragma: no cover - depends on the build
    _C_ERROR = f"spec_ext._C is not built or failed to load ({error})"
    warnings.warn(f"spec_ext: {_C_ERROR}. Only the torch and triton backends are available; "
                  "build the C++/CUDA kernels with `pip install --no-build-isolation -e .`",
                  RuntimeWarning, stacklevel=2)

_validate_default = True


def set_validation(enabled: bool) -> None:
    """Switch host-syncing input checks on or off for every op (default on)."""
    global _validate_default
    _validate_default = bool(enabled)


def _validating(validate: bool | None) -> bool:
    return _validate_default if validate is None else validate


# ------------------------------------------------------------------------ backends
def registered(op: str, key: str) -> bool:
    """Whether the compiled extension registered a kernel of ``spec_ext::op`` for ``key``."""
    if _C_ERROR is not None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"spec_ext::{op}", key)


@functools.lru_cache(None)
def _triton_status() -> str | None:
    """None when the Triton kernels can run on this machine, else why not."""
    try:
        importlib.import_module("spec_ext.kernels.tree")
    except ImportError as error:
        return f"Triton kernels cannot be imported ({error})"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device (set TRITON_INTERPRET=1 before importing triton to run them on CPU)"
    return None


def backends() -> dict[str, str]:
    """Each backend's status: ``"available"`` or ``"unavailable: <reason>"``."""
    def status(reason):
        return "available" if reason is None else f"unavailable: {reason}"
    cpu_missing = [op for op in OPS if not registered(op, "CPU")]
    cuda_missing = [op for op in OPS if "CUDA" in KERNEL_KEYS[op] and not registered(op, "CUDA")]
    cuda_reason = _C_ERROR or (f"CUDA kernels not built ({', '.join(cuda_missing)} missing)" if cuda_missing
                               else None if torch.cuda.is_available() else "built, but no CUDA device")
    return {
        "torch": status(None),
        "cpu": status(_C_ERROR or (f"missing CPU kernels: {cpu_missing}" if cpu_missing else None)),
        "triton": status(_triton_status()),
        "cuda": status(cuda_reason),
    }


@functools.lru_cache(None)
def _resolve(backend: str, device: torch.device, op: str) -> str:
    """The backend that serves ``op`` for tensors on ``device`` (cached: registrations are
    fixed once the extension is loaded)."""
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            if registered(op, "CUDA"):
                return "cuda"
            return "triton" if _triton_status() is None else "torch"
        return "cpu" if device.type == "cpu" and registered(op, "CPU") else "torch"
    if backend == "cpu" and (device.type != "cpu" or not registered(op, "CPU")):
        raise ValueError(f"backend='cpu' needs CPU tensors and the built extension "
                         f"(tensors on {device}; {backends()['cpu']})")
    if backend == "cuda" and (device.type != "cuda" or not registered(op, "CUDA")):
        raise ValueError(f"backend='cuda' needs CUDA tensors and the built CUDA kernels "
                         f"(tensors on {device}; {backends()['cuda']})")
    if backend == "triton":
        reason = _triton_status()
        if reason is not None:
            raise ValueError(f"backend='triton' is unavailable: {reason}")
    return backend


def _triton(family: str):
    return importlib.import_module(f"spec_ext.kernels.{family}")


# ------------------------------------------------------------------------ checks
def _fail(name: str, problem: str):
    raise ValueError(f"{name}: {problem}")


def _check_tensor(name: str, x, ndim: int | tuple[int, ...], dtypes=None, device=None) -> None:
    if not isinstance(x, Tensor):
        _fail(name, f"expected a Tensor, got {type(x).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.dim() not in ndims:
        _fail(name, f"expected {' or '.join(f'{n}-D' for n in ndims)}, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        _fail(name, f"expected dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if device is not None and x.device != device:
        _fail(name, f"expected device {device}, got {x.device}")


def _check_shape(name: str, x: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        _fail(name, f"expected shape {tuple(shape)}, got {tuple(x.shape)}")


def _check_ids(name: str, ids: Tensor, upper: int) -> None:
    if ids.numel() and bool(((ids < -1) | (ids >= upper)).any()):
        _fail(name, f"ids must be -1 (padding) or in [0, {upper}); found {ids[(ids < -1) | (ids >= upper)][0].item()}")


def _check_distributions(name: str, probs: Tensor, rows: Tensor | None = None) -> None:
    """probs [..., V]: finite, non-negative, positive sum (on the rows selected by ``rows``)."""
    data = probs if rows is None else probs[rows]
    if data.numel() == 0:
        return
    if not bool(torch.isfinite(data).all()):
        _fail(name, "contains NaN or inf")
    if bool((data < 0).any()):
        _fail(name, "contains negative probabilities")
    if bool((data.sum(-1) <= 0).any()):
        _fail(name, "contains an all-zero probability row")


# ------------------------------------------------------------------------ trees
def tree_mask(parents: Tensor, backend: str = "auto", validate: bool | None = None) -> tuple[Tensor, Tensor]:
    """Depth and packed attention bits of a batch of trees.

    Args:
        parents: [B,T] or [T] int64; ``parents[..., 0] == -1`` (the root), ``0 <= parents[i] < i``.
    Returns:
        depth [B,T] int64 and mask [B,T,ceil(T/32)] int32 (bit j of mask[b,i]: node i attends node j).

    Example:
        >>> depth, mask = tree_mask(torch.tensor([-1, 0, 0, 1]))
        >>> depth.tolist(), mask[0, :, 0].tolist()
        ([[0, 1, 1, 2]], [1, 3, 5, 11])
    """
    _check_tensor("parents", parents, (1, 2), (torch.int64,))
    parents = parents if parents.dim() == 2 else parents.unsqueeze(0)
    if _validating(validate):
        _check_parents(parents)
    impl = _resolve(backend, parents.device, "tree_mask")
    if impl == "torch":
        return reference.tree_mask(parents)
    if impl == "triton":
        return _triton("tree").tree_mask(parents)
    return torch.ops.spec_ext.tree_mask(parents)


def _check_parents(parents: Tensor) -> None:
    if parents.shape[-1] == 0:
        _fail("parents", "a tree needs at least its root (T >= 1)")
    if bool((parents[:, 0] != -1).any()):
        _fail("parents", "node 0 must be the root (parents[..., 0] == -1)")
    index = torch.arange(parents.shape[1], device=parents.device)
    bad = (parents[:, 1:] < 0) | (parents[:, 1:] >= index[1:])
    if bool(bad.any()):
        b, i = (int(v) for v in torch.nonzero(bad)[0])
        _fail("parents", f"parents[{b}, {i + 1}] = {int(parents[b, i + 1])}; every non-root node i needs "
                         f"0 <= parent < i (one root, nodes in topological order)")


# ------------------------------------------------------------------------ sampling
class ChainResult(NamedTuple):
    tokens: Tensor        # [B,K+1] emitted tokens (accepted drafts, then one more), -1 padded
    num_accepted: Tensor  # [B]


class TreeResult(NamedTuple):
    path: Tensor          # [B,Dmax+1] accepted node ids from the root (0), -1 padded
    tokens: Tensor        # [B,Dmax+1] emitted tokens, -1 padded
    num_accepted: Tensor  # [B]


def _chain_args(target: Tensor, draft_tokens: Tensor, num_draft: Tensor | None, validate: bool):
    _check_tensor("target", target, 3, (torch.float32,))
    B, K1, V = target.shape
    _check_tensor("draft_tokens", draft_tokens, 2, (torch.int64,), target.device)
    _check_shape("draft_tokens", draft_tokens, (B, K1 - 1))
    if num_draft is None:
        num_draft = torch.full((B,), K1 - 1, dtype=torch.int64, device=target.device)
    _check_tensor("num_draft", num_draft, 1, (torch.int64,), target.device)
    _check_shape("num_draft", num_draft, (B,))
    if validate:
        if bool(((num_draft < 0) | (num_draft > K1 - 1)).any()):
            _fail("num_draft", f"every entry must be in [0, K={K1 - 1}]")
        _check_ids("draft_tokens", draft_tokens, V)
    return num_draft


def _uniforms(uniforms: Tensor | None, shape: tuple[int, int], device, generator) -> Tensor:
    if uniforms is None:
        return torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    _check_tensor("uniforms", uniforms, 2, (torch.float64,), device)
    _check_shape("uniforms", uniforms, shape)
    return uniforms


def chain_rejection_sample(target_probs: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None = None,
                           num_draft: Tensor | None = None, uniforms: Tensor | None = None,
                           generator: torch.Generator | None = None, backend: str = "auto",
                           validate: bool | None = None) -> ChainResult:
    """Verify a padded batch of draft chains by rejection sampling (exact: the emitted
    tokens follow the target distribution).

    Args:
        target_probs: [B,K+1,V] float32; row i is p after the prefix and drafts < i.
        draft_tokens: [B,K] int64; -1 (or positions >= num_draft) means no draft.
        draft_probs: [B,K,V] float32, the q each draft was sampled from; None for
            deterministic drafts (one-hot q).
        num_draft: [B] int64 drafts per row (default K).
        uniforms: [B,K+1] float64 coins: column j for draft j, the last for the final
            (residual or bonus) draw by inverse CDF. Drawn with ``generator`` when None.
    Returns:
        ChainResult(tokens [B,K+1] -1 padded, num_accepted [B]); row b emits
        ``tokens[b, :num_accepted[b] + 1]``.

    Example:
        >>> p = torch.softmax(torch.randn(2, 4, 16), -1)
        >>> q = torch.softmax(torch.randn(2, 3, 16), -1)
        >>> drafts = torch.multinomial(q.view(-1, 16), 1).view(2, 3)
        >>> tokens, num_accepted = chain_rejection_sample(p, drafts, q)
    """
    check = _validating(validate)
    num_draft = _chain_args(target_probs, draft_tokens, num_draft, check)
    B, K1, V = target_probs.shape
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, 3, (torch.float32,), target_probs.device)
        _check_shape("draft_probs", draft_probs, (B, K1 - 1, V))
    uniforms = _uniforms(uniforms, (B, K1), target_probs.device, generator)
    if check:
        positions = torch.arange(K1, device=target_probs.device)
        _check_distributions("target_probs", target_probs, positions <= num_draft[:, None])
        if draft_probs is not None:
            _check_distributions("draft_probs", draft_probs, positions[:-1] < num_draft[:, None])
    return ChainResult(*_call_chain(backend, target_probs, draft_tokens, draft_probs, num_draft, uniforms, False))


def greedy_verify(target_logits: Tensor, draft_tokens: Tensor, num_draft: Tensor | None = None,
                  backend: str = "auto", validate: bool | None = None) -> ChainResult:
    """Greedy verification: accept drafts while they equal the target's argmax (first
    index on ties), then emit the argmax. Shapes as :func:`chain_rejection_sample`;
    ``target_logits`` [B,K+1,V] may be logits or probabilities (float32, float16, bfloat16).

    Example:
        >>> logits = torch.randn(1, 3, 10)
        >>> greedy_verify(logits, logits[:, :2].argmax(-1)).num_accepted.tolist()
        [2]
    """
    if isinstance(target_logits, Tensor) and target_logits.dtype in (torch.float16, torch.bfloat16):
        target_logits = target_logits.float()
    check = _validating(validate)
    num_draft = _chain_args(target_logits, draft_tokens, num_draft, check)
    if check and not bool(torch.isfinite(target_logits).all()):
        _fail("target_logits", "contains NaN or inf")
    return ChainResult(*_call_chain(backend, target_logits, draft_tokens, None, num_draft, None, True))


def _call_chain(backend, target, draft_tokens, draft_probs, num_draft, uniforms, greedy):
    impl = _resolve(backend, target.device, "chain_verify")
    if impl == "torch":
        return reference.chain_verify(target, draft_tokens, draft_probs, num_draft, uniforms, greedy)
    if impl == "triton":
        return _triton("rejection_sampling").chain_verify(target, draft_tokens, draft_probs, num_draft,
                                                          uniforms, greedy)
    return torch.ops.spec_ext.chain_verify(target, draft_tokens, draft_probs, num_draft, uniforms, greedy)


def _tree_args(target: Tensor, tree_tokens: Tensor, parents: Tensor, validate: bool) -> Tensor:
    _check_tensor("target", target, 3, (torch.float32,))
    B, T, V = target.shape
    _check_tensor("tree_tokens", tree_tokens, 2, (torch.int64,), target.device)
    _check_shape("tree_tokens", tree_tokens, (B, T))
    _check_tensor("parents", parents, (1, 2), (torch.int64,), target.device)
    if parents.shape[-1] != T or (parents.dim() == 2 and parents.shape[0] not in (1, B)):
        _fail("parents", f"expected [T={T}], [1, T] or [B={B}, T], got {tuple(parents.shape)}")
    parents = parents.expand(B, T)
    if validate:
        _check_parents(parents)
        _check_ids("tree_tokens", tree_tokens[:, 1:], V)
    return parents.contiguous()


def tree_rejection_sample(target_probs: Tensor, tree_tokens: Tensor, parents: Tensor,
                          draft_probs: Tensor | None = None, siblings: str = "without_replacement",
                          uniforms: Tensor | None = None, generator: torch.Generator | None = None,
                          max_depth: int | None = None, backend: str = "auto",
                          validate: bool | None = None) -> TreeResult:
    """Verify a batch of draft trees by multi-draft recursive rejection sampling (exact).

    Args:
        target_probs: [B,T,V] float32; row i is p after node i (node 0 is the root, the
            last committed token).
        tree_tokens: [B,T] int64 node tokens (the root's is ignored; -1 marks an absent node).
        parents: [T], [1,T] or [B,T] int64; ``parents[0] == -1``, ``parents[i] < i``.
        draft_probs: [B,T,V] float32: q that node i's children were sampled from; None
            for deterministic drafts (e.g. top-k children).
        siblings: ``"without_replacement"`` (children drawn without replacement from q;
            each rejected one is removed from q) or ``"iid"`` (q unchanged).
        uniforms: [B,T+1] float64: column i is node i's coin, the last the final draw.
        max_depth: the trees' greatest depth (Dmax) when the caller knows it (e.g. a
            static tree); otherwise computed from ``parents`` (one more launch and a sync).
    Returns:
        TreeResult(path [B,Dmax+1], tokens [B,Dmax+1], num_accepted [B]), -1 padded.

    Example:
        >>> parents = torch.tensor([-1, 0, 0, 1])
        >>> p = torch.softmax(torch.randn(1, 4, 8), -1)
        >>> result = tree_rejection_sample(p, torch.tensor([[5, 1, 2, 3]]), parents)
    """
    if siblings not in ("without_replacement", "iid"):
        raise ValueError(f"siblings: expected 'without_replacement' or 'iid', got {siblings!r}")
    check = _validating(validate)
    parents = _tree_args(target_probs, tree_tokens, parents, check)
    B, T, V = target_probs.shape
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, 3, (torch.float32,), target_probs.device)
        _check_shape("draft_probs", draft_probs, (B, T, V))
    uniforms = _uniforms(uniforms, (B, T + 1), target_probs.device, generator)
    if check:
        _check_distributions("target_probs", target_probs)
        if draft_probs is not None:
            has_children = torch.zeros(B, T, dtype=torch.bool, device=target_probs.device)
            has_children.scatter_(1, parents[:, 1:].clamp_min(0), tree_tokens[:, 1:] >= 0)
            _check_distributions("draft_probs", draft_probs, has_children)
    return _call_tree(backend, target_probs, tree_tokens, parents, draft_probs, uniforms, False,
                      siblings == "without_replacement", max_depth, check)


def tree_greedy_verify(target_logits: Tensor, tree_tokens: Tensor, parents: Tensor, max_depth: int | None = None,
                       backend: str = "auto", validate: bool | None = None) -> TreeResult:
    """Greedy tree verification: from the root, follow the first child whose token is the
    target's argmax; emit the argmax where none is. Shapes as :func:`tree_rejection_sample`."""
    if isinstance(target_logits, Tensor) and target_logits.dtype in (torch.float16, torch.bfloat16):
        target_logits = target_logits.float()
    check = _validating(validate)
    parents = _tree_args(target_logits, tree_tokens, parents, check)
    if check and not bool(torch.isfinite(target_logits).all()):
        _fail("target_logits", "contains NaN or inf")
    return _call_tree(backend, target_logits, tree_tokens, parents, None, None, True, True, max_depth, check)


def _call_tree(backend, target, tree_tokens, parents, draft_probs, uniforms, greedy, without_replacement,
               max_depth, check):
    impl = _resolve(backend, target.device, "tree_verify")
    if impl == "torch":
        out = reference.tree_verify(target, tree_tokens, parents, draft_probs, uniforms, greedy,
                                    without_replacement)
    elif impl == "triton":
        out = _triton("rejection_sampling").tree_verify(target, tree_tokens, parents, draft_probs, uniforms,
                                                        greedy, without_replacement)
    else:
        out = torch.ops.spec_ext.tree_verify(target, tree_tokens, parents, draft_probs, uniforms, greedy,
                                             without_replacement)
    if max_depth is None:
        max_depth = int(tree_mask(parents, validate=False)[0].max())
    elif check and bool((out[0][:, max_depth + 1:] >= 0).any()):
        _fail("max_depth", f"{max_depth} is less than the depth of an accepted path")
    width = max_depth + 1
    return TreeResult(out[0][:, :width], out[1][:, :width], out[2])


# ------------------------------------------------------------------------ attention
def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_lens: Tensor, tree_mask: Tensor | None = None,
                   scale: float | None = None, backend: str = "auto", validate: bool | None = None) -> Tensor:
    """Attention of T new tokens (a chain or a tree) over a per-row cached prefix.

    Key position s is visible to query i of row b iff ``s < prefix_lens[b]``, or
    ``s = prefix_lens[b] + j`` and bit j of ``tree_mask[b, i]`` is set (None: causal over
    the T new tokens). Keys from ``prefix_lens[b] + T`` on are never read.

    Args:
        q: [B,Hq,T,D] float32/float16/bfloat16.
        k, v: [B,Hkv,S,D], same dtype and device; ``Hq % Hkv == 0`` (GQA).
        prefix_lens: [B] int32 or int64, ``prefix_lens + T <= S``.
        tree_mask: [B,T,W] or [1,T,W] int32 packed bits (see :func:`tree_mask`), W >= ceil(T/32).
        scale: softmax scale, default ``D ** -0.5``.
    Returns:
        [B,Hq,T,D] in q's dtype.

    Example:
        >>> q = torch.randn(2, 4, 3, 64); k = v = torch.randn(2, 2, 16, 64)
        >>> out = tree_attention(q, k, v, torch.tensor([5, 13]), tree_mask(torch.tensor([-1, 0, 0]))[1])
    """
    float_types = (torch.float32, torch.float16, torch.bfloat16)
    _check_tensor("q", q, 4, float_types)
    _check_tensor("k", k, 4, (q.dtype,), q.device)
    _check_tensor("v", v, 4, (q.dtype,), q.device)
    B, Hq, T, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        _fail("k", f"expected [B={B}, Hkv, S, D={D}], got {tuple(k.shape)}")
    _check_shape("v", v, tuple(k.shape))
    if k.shape[1] == 0 or Hq % k.shape[1]:
        _fail("k", f"query heads ({Hq}) must be a multiple of key/value heads ({k.shape[1]})")
    _check_tensor("prefix_lens", prefix_lens, 1, (torch.int32, torch.int64), q.device)
    _check_shape("prefix_lens", prefix_lens, (B,))
    if tree_mask is not None:
        _check_tensor("tree_mask", tree_mask, 3, (torch.int32,), q.device)
        if tree_mask.shape[0] not in (1, B) or tree_mask.shape[1] != T or tree_mask.shape[2] * 32 < T:
            _fail("tree_mask", f"expected [B={B} or 1, T={T}, W>={(T + 31) // 32}], got {tuple(tree_mask.shape)}")
    if _validating(validate) and B:
        if bool((prefix_lens < 0).any()) or bool((prefix_lens + T > k.shape[2]).any()):
            _fail("prefix_lens", f"need 0 <= prefix_lens and prefix_lens + T ({T}) <= S ({k.shape[2]}); "
                                 f"got {prefix_lens.tolist()}")
    scale = D ** -0.5 if scale is None else float(scale)
    return _attention_impl(_resolve(backend, q.device, "tree_attention"))(q, k, v, prefix_lens, tree_mask, scale)


def _attention_impl(impl: str):
    if impl == "torch":
        return reference.tree_attention
    if impl == "triton":
        return _triton("tree_attention").tree_attention
    return torch.ops.spec_ext.tree_attention


def tree_attention_kernel(device: torch.device | str):
    """The implementation :func:`tree_attention` dispatches to for tensors on ``device``
    (backend "auto"), as a function ``(q, k, v, prefix_lens, tree_mask, scale) -> out``
    that checks nothing: for per-layer calls whose shapes the caller already guarantees
    (a model forward makes several hundred calls a second, each check costs microseconds).

    Example:
        >>> attend = tree_attention_kernel("cpu")
        >>> q = torch.randn(1, 4, 3, 64); k = v = torch.randn(1, 2, 16, 64)
        >>> out = attend(q, k, v, torch.tensor([5]), None, 0.125)
    """
    return _attention_impl(_resolve("auto", torch.device(device), "tree_attention"))


# ------------------------------------------------------------------------ linear
SKINNY_ROWS = 48  # up to this many rows the CPU kernel beats MKL: 2.5-4x at 1-8 rows, 1.1-1.5x at 16-48


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, backend: str = "auto") -> Tensor:
    """``x @ weight.T + bias`` for a few rows of x (a decode step, a verification block):
    what ``torch.nn.functional.linear`` computes, faster on CPU when x has at most
    ``SKINNY_ROWS`` rows in all. The CPU kernel streams each weight row once for every row
    of x (MKL packs cold weights first and reads them at a quarter of the speed here); it
    sums in a fixed order, so a row's result is the same bits whatever other rows come with
    it, but not the same bits as MKL's (float32 rounding apart). Other cases (more rows,
    other dtypes or devices, no AVX-512: a portable loop, correct but slower than MKL) take
    ``F.linear``.

    Args:
        x: [..., K] float32 (other dtypes go to F.linear).
        weight: [N, K], same dtype and device. bias: [N] or None.
        backend: "auto" (the kernel when it applies, else F.linear), "cpu" (the kernel,
            any row count) or "torch" (the float64 reference).
    Returns:
        [..., N] in x's dtype.

    Example:
        >>> w = torch.randn(864, 320); x = torch.randn(1, 5, 320)
        >>> y = skinny_linear(x, w)         # [1, 5, 864], close to F.linear(x, w)
    """
    _check_tensor("x", x, tuple(range(1, 8)), (torch.float32, torch.float16, torch.bfloat16))
    _check_tensor("weight", weight, 2, (x.dtype,), x.device)
    if weight.shape[1] != x.shape[-1]:
        _fail("weight", f"expected [N, K={x.shape[-1]}] (K = x's last dim), got {tuple(weight.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, 1, (x.dtype,), x.device)
        _check_shape("bias", bias, (weight.shape[0],))
    if backend == "torch":
        return reference.skinny_linear(x, weight, bias)
    if backend == "cpu":
        _resolve("cpu", x.device, "skinny_linear")
        if x.dtype != torch.float32:
            _fail("x", f"backend='cpu' takes float32, got {x.dtype}")
        return torch.ops.spec_ext.skinny_linear(x, weight, bias)
    if backend != "auto":
        raise ValueError(f"backend must be one of ('auto', 'cpu', 'torch') for skinny_linear, got {backend!r}")
    return skinny_linear_kernel(x.device, x.dtype)(x, weight, bias)


def skinny_linear_kernel(device: torch.device | str, dtype: torch.dtype = torch.float32):
    """What :func:`skinny_linear` (backend "auto") runs for x on ``device`` in ``dtype``, as
    an unchecked function ``(x, weight, bias) -> y``: the CPU kernel up to ``SKINNY_ROWS``
    rows of x and F.linear beyond them, or F.linear wherever the kernel does not apply."""
    device = torch.device(device)
    if (device.type != "cpu" or dtype != torch.float32 or not registered("skinny_linear", "CPU")
            or torch.backends.cpu.get_cpu_capability() != "AVX512"):
        return F.linear
    kernel = torch.ops.spec_ext.skinny_linear

    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return kernel(x, weight, bias) if x.numel() <= SKINNY_ROWS * x.shape[-1] else F.linear(x, weight, bias)

    return linear


# ------------------------------------------------------------------------ policies
def acceptance_head(hidden: Tensor, probs: Tensor, weights: Sequence[Tensor], column: int, eps: float = 1e-5,
                    backend: str = "auto") -> Tensor:
    """SpecDecPP's predicted chance that the token drawn from ``probs`` is accepted: a
    residual MLP (:class:`spec_ext.learned.ResidualMLP`) on [hidden; log max p; entropy of
    p; max p - second largest p], sigmoid of output ``column``; one call per draft step.

    Args:
        hidden: [B,H] float32, the draft's last hidden state. probs: [B,V] float32, the
            distribution the draft gave from it (temperature 1).
        weights: float32 tensors in ResidualMLP's order (its ``weights()``): inp.weight
            [D,H+3], inp.bias [D], per block norm.weight [D], norm.bias [D], up.weight [D,D],
            up.bias [D], down.weight [D,D], down.bias [D]; out.weight [O,D], out.bias [O].
        column: output of the MLP to read (0 <= column < O). eps: the LayerNorms' epsilon.
        backend: "auto" (the CPU kernel for CPU tensors, else the float64 reference), "cpu" or
            "torch". :class:`spec_ext.learned.SpecDecPP` calls the kernel unchecked, and on
            other devices composes the same arithmetic from float32 torch ops.
    Returns:
        [B] float32 in (0, 1).

    Example:
        >>> from spec_ext.learned import ResidualMLP
        >>> head = ResidualMLP(64 + 3, hidden=32, depth=1)
        >>> probs = torch.softmax(torch.randn(2, 100), -1)
        >>> accept = acceptance_head(torch.randn(2, 64), probs, head.weights(), column=0)  # [2]
    """
    _check_tensor("hidden", hidden, 2, (torch.float32,))
    _check_tensor("probs", probs, 2, (torch.float32,), hidden.device)
    if probs.shape[0] != hidden.shape[0] or probs.shape[1] < 2:
        _fail("probs", f"expected [B={hidden.shape[0]}, V>=2], got {tuple(probs.shape)}")
    weights = [w.contiguous() if isinstance(w, Tensor) else w for w in weights]
    if len(weights) < 4 or (len(weights) - 4) % 6:
        _fail("weights", f"expected 4 + 6 * depth tensors (ResidualMLP.weights()), got {len(weights)}")
    D = weights[0].shape[0]
    shapes = [(D, hidden.shape[1] + 3), (D,)] + [(D,), (D,), (D, D), (D,), (D, D), (D,)] * ((len(weights) - 4) // 6)
    shapes += [(weights[-2].shape[0], D), (weights[-2].shape[0],)]
    for n, (w, shape) in enumerate(zip(weights, shapes)):
        _check_tensor(f"weights[{n}]", w, len(shape), (torch.float32,), hidden.device)
        _check_shape(f"weights[{n}]", w, shape)
    if not 0 <= column < weights[-2].shape[0]:
        _fail("column", f"expected 0 <= column < {weights[-2].shape[0]} (the MLP's outputs), got {column}")
    if backend not in ("auto", "cpu", "torch"):
        raise ValueError(f"backend must be one of ('auto', 'cpu', 'torch') for acceptance_head, got {backend!r}")
    if _resolve(backend, hidden.device, "acceptance_head") == "torch":
        return reference.acceptance_head(hidden, probs, weights, column, eps)
    return torch.ops.spec_ext.acceptance_head(hidden, probs, weights, column, eps)


# ------------------------------------------------------------------------ kv cache
def compact_kv(caches: Sequence[Tensor] | Tensor, src: Tensor, dst_start: Tensor, backend: str = "auto",
               validate: bool | None = None) -> None:
    """Move cache positions in place: for every tensor, row b's ``src[b, j]`` goes to
    ``dst_start[b] + j`` (j before the row's first -1). Overlapping ranges are fine.

    Args:
        caches: list of [B,H,S,D] tensors (e.g. every layer's K and V) or one stacked
            [N,B,H,S,D] tensor; contiguous, same shape, dtype and device.
        src: [B,M] int64 source positions, -1 padded at the end.
        dst_start: [B] int64 first destination position.

    Example:
        >>> kv = torch.randn(4, 2, 8, 32, 64)      # 2 layers x (K, V), B=2, S=32
        >>> compact_kv(kv, torch.tensor([[10, 12], [7, -1]]), torch.tensor([10, 7]))
    """
    if isinstance(caches, Tensor):
        _check_tensor("caches", caches, 5)
        tensors = list(caches.unbind(0))
    else:
        tensors = list(caches)
    if not tensors:
        return
    first = tensors[0]
    for n, t in enumerate(tensors):
        _check_tensor(f"caches[{n}]", t, 4, (torch.float32, torch.float16, torch.bfloat16), first.device)
        if t.shape != first.shape or t.dtype != first.dtype:
            _fail(f"caches[{n}]", f"expected shape {tuple(first.shape)} and dtype {first.dtype} like caches[0], "
                                  f"got {tuple(t.shape)} {t.dtype}")
        if not t.is_contiguous():
            _fail(f"caches[{n}]", "must be contiguous")
    B, _, S, _ = first.shape
    _check_tensor("src", src, 2, (torch.int64,), first.device)
    if src.shape[0] != B:
        _fail("src", f"expected [B={B}, M], got {tuple(src.shape)}")
    _check_tensor("dst_start", dst_start, 1, (torch.int64,), first.device)
    _check_shape("dst_start", dst_start, (B,))
    if _validating(validate) and src.numel():
        valid = src >= 0
        if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
            _fail("src", "-1 padding must come after every valid position of its row")
        if bool((src >= S).any()) or bool((src < -1).any()):
            _fail("src", f"positions must be in [0, S={S}) or -1")
        count = valid.sum(1)
        if bool((dst_start < 0).any()) or bool(((dst_start + count > S) & (count > 0)).any()):
            _fail("dst_start", f"need 0 <= dst_start and dst_start + moved <= S ({S})")
    impl = _resolve(backend, first.device, "compact_kv")
    if impl == "torch":
        reference.compact_kv(tensors, src, dst_start)
    elif impl == "triton":
        _triton("kv_cache").compact_kv(tensors, src, dst_start)
    else:
        torch.ops.spec_ext.compact_kv(tensors, src, dst_start)


# ------------------------------------------------------------------------ fakes
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
    def _(q, k, v, prefix_lens, tree_mask, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("spec_ext::compact_kv")
    def _(caches, src, dst_start):
        return None

    @torch.library.register_fake("spec_ext::skinny_linear")
    def _(x, weight, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("spec_ext::acceptance_head")
    def _(hidden, probs, weights, column, eps):
        return probs.new_empty(probs.shape[0])
