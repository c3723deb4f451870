"""Tree / branch attention: T new tokens (a chain or a tree) over a per-row cached prefix."""
from __future__ import annotations

import functools
import math
import numbers

import torch
from torch import Tensor

from spec_ext.ops import registry
from spec_ext.ops.checks import FLOAT_TYPES, check_shape, check_tensor, fail


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_lens: Tensor, tree_mask: Tensor | None = None,
                   scale: float | None = None, window: int | None = None, softcap: float | None = None,
                   sinks: Tensor | None = None, backend: str = "auto", validate: bool | None = None,
                   invariant: bool = False) -> Tensor:
    """Attention of T new tokens (a chain or a tree) over a per-row cached prefix.

    Key position s is visible to query i of row b iff ``s < prefix_lens[b]``, or
    ``s = prefix_lens[b] + j`` and bit j of ``tree_mask[b, i]`` is set (None: causal over
    the T new tokens). Keys no query of a row can see, from ``prefix_lens[b] + T`` on and
    (with a window) below its shallowest query's window (at and below
    ``prefix_lens[b] - window``: the root sits at ``prefix_lens[b]``), never reach that
    row's output on the cpu, cuda, triton, triton_split and triton_invariant backends, so
    they may hold anything, NaN included (those kernels never load them, but for the C++
    kernel's batched GEMMs over a ragged batch, which read the rows' common span and redo a
    row that comes out NaN over its own keys). The torch and sdpa backends multiply them by
    weight 0, so there, and with "auto", which may pick those, they must be finite (0 * NaN
    is NaN).

    Positions: prefix key s sits at s, tree node j at ``prefix_lens[b] + depth(j)``, where
    depth is the number of ancestors (node j of the causal chain: j; with a mask: the
    popcount of row j minus one).

    Width invariance (``invariant=True``, docs/invariance.md): each query's output is the same
    bits whatever T and whatever the other queries are, so query i of a causal block of T
    equals that query computed alone (T = 1, ``prefix_lens + i``, the block's earlier tokens
    in the cache), which is what makes a verification's logits equal a plain decode step's.
    The backends that give it: "cpu" (with ``invariant=True`` the C++ kernel takes its
    one-query-at-a-time path at every T, spec_ext::tree_attention_invariant: also the same
    bits for a tree node over its path compacted; tested), "cuda" (each query's online
    softmax goes key by key in rising order in its own warp, whatever T: invariant by
    construction, also over a compacted path, not yet checked on a GPU) and
    "triton_invariant" (one program per query, keys in fixed blocks of key space; tested in
    the Triton interpreter, not yet run on a GPU; not invariant to compaction). Not
    invariant: "torch" and "sdpa" (PyTorch's matmuls and SDPA kernels pick their algorithm
    by the query count), "triton" and "triton_split" (query tiles sized from T, ``tl.dot``
    on them), the "cpu" kernel without ``invariant`` (from T = 2 on, batched GEMMs; at T = 1
    it is the invariant path), and so "auto" without ``invariant``.

    Args:
        q: [B,Hq,T,D] float32/float16/bfloat16.
        k: [B,Hkv,S,D], same dtype and device; ``Hq % Hkv == 0`` (GQA).
        v: [B,Hkv,S,Dv], same dtype and device. Dv may differ from D (MLA: DeepSeek-V3's keys
            are ``qk_nope_head_dim + qk_rope_head_dim`` wide, its values ``v_head_dim``) on the
            torch, sdpa, cpu and triton_invariant backends; the cuda, triton and triton_split
            kernels take Dv = D only and refuse others by name, and "auto" sends such calls to
            sdpa (no softcap or sinks) or torch on a GPU (on a CPU it picks among sdpa and cpu
            as for any call; with ``invariant`` on a GPU, triton_invariant).
        prefix_lens: [B] int32 or int64, ``prefix_lens + T <= S``.
        tree_mask: [B,T,W] or [1,T,W] int32 packed bits (see :func:`tree_mask`), W >= ceil(T/32).
        scale: softmax scale, default ``D ** -0.5``.
        window: sliding window (Mistral, Gemma-2/3 local layers, GPT-OSS): a query at position
            p sees a key at position s only if ``p - s < window``; None (default) or an int >= 1.
        softcap: the scaled scores become ``softcap * tanh(score / softcap)`` before the mask
            (Gemma-2); None (default) or a float > 0.
        sinks: [Hq] float32/float16/bfloat16 on q's device (GPT-OSS, whose ``s_aux`` is in the
            model's dtype): one extra logit per query head in the softmax's denominator, compared
            with the scaled, soft-capped scores (every backend reads it in float32); it has no
            value, so it only takes weight from the keys. None (default): no sink.
        backend: "auto", "torch", "cpu", "cuda", "triton", or "triton_split" (split over the
            keys, flash-decoding style, for few rows on a GPU; not yet run on a GPU, so never
            chosen by "auto"), or "triton_invariant" (see width invariance above; opt-in).
        validate: False skips every check (a model forward calls this once per layer).
        invariant: True takes a width-invariant kernel: with "auto", the C++ one on CPU, on a
            GPU "cuda" where built, else "triton_invariant"; "cpu", "cuda" and
            "triton_invariant" may be named; any other backend is a ValueError naming ``backend``.
    Returns:
        [B,Hq,T,Dv] in q's dtype. A query that sees no key (possible only through a mask row
        without its own bit) gets zeros, whatever its sink (a sink of -inf is no sink).

    Example:
        >>> q = torch.randn(2, 4, 3, 64); k = v = torch.randn(2, 2, 16, 64)
        >>> mask = tree_mask(torch.tensor([-1, 0, 0]))[1]
        >>> out = tree_attention(q, k, v, torch.tensor([5, 13]), mask, window=4, softcap=50.0,
        ...                      sinks=torch.zeros(4))
    """
    if registry.checking(validate):
        _check(q, k, v, prefix_lens, tree_mask, window, softcap, sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    window = 0 if window is None else int(window)
    softcap = 0.0 if softcap is None else float(softcap)
    if invariant:
        if v.shape[-1] != q.shape[-1] and backend == "auto" and q.device.type != "cpu":
            backend = "triton_invariant"  # the CUDA kernel takes Dv = D only
        elif v.shape[-1] != q.shape[-1]:
            _value_head_backend(backend, q.device, softcap, sinks, q.shape[-1], v.shape[-1])
        return invariant_attention(q.device, backend)(q, k, v, prefix_lens, tree_mask, scale, window, softcap, sinks)
    if v.shape[-1] != q.shape[-1]:
        backend = _value_head_backend(backend, q.device, softcap, sinks, q.shape[-1], v.shape[-1])
    return registry.kernel("tree_attention", backend, q.device)(q, k, v, prefix_lens, tree_mask, scale,
                                                                window, softcap, sinks)


# the backends whose every query's output is independent of T (with invariant=True: "cpu" is
# the C++ kernel's invariant entry point, spec_ext::tree_attention_invariant)
INVARIANT_BACKENDS = ("cpu", "cuda", "triton_invariant")


def invariant_attention(device: torch.device | str, backend: str = "auto"):
    """The kernel-level function (the schema's arguments: q, k, v, prefix_lens, tree_mask,
    scale, window, softcap, sinks; unchecked) of the width-invariant tree attention on
    ``device``: ``backend`` "auto" gives the C++ kernel's invariant entry point on CPU, on a
    GPU the CUDA kernel where it is built, else "triton_invariant"; "cpu", "cuda" or
    "triton_invariant" name one. ValueError naming ``backend`` for a backend that is not
    invariant or cannot run here (a model forward takes this once, not per layer)."""
    return _invariant_attention(torch.device(device), backend)


@functools.lru_cache(None)
def _invariant_attention(device: torch.device, backend: str):
    if backend == "auto":
        backend = ("cpu" if device.type == "cpu" else
                   "cuda" if device.type == "cuda" and registry.registered("tree_attention", "CUDA") else
                   "triton_invariant")
    if device.type not in ("cpu", "cuda"):
        fail("backend", f"no width-invariant tree attention on {device} (CPU and CUDA only)")
    if backend not in INVARIANT_BACKENDS:
        fail("backend", f"{backend!r} is not width-invariant (a query's output depends on T there); with "
                        f"invariant=True use 'auto' or one of {INVARIANT_BACKENDS}")
    op = "tree_attention_invariant" if backend == "cpu" else "tree_attention"
    try:
        return registry.kernel(op, registry.resolve(op, backend, device), device)
    except ValueError as error:
        fail("backend", f"no width-invariant tree attention on {device} with {backend!r}: {error}")


# the kernels that take values of the keys' head size only (their tiles span one D)
_SAME_HEAD_SIZE_ONLY = ("cuda", "triton", "triton_split")


def _value_head_backend(backend: str, device: torch.device, softcap: float, sinks, D: int, Dv: int) -> str:
    """The backend for values of another head size than the keys' (Dv != D): ``backend``
    where it takes them; for "auto" on a GPU, sdpa (no softcap or sinks) or torch, never the
    cuda or triton kernels (where the measured table is off too); ValueError naming those."""
    if backend in _SAME_HEAD_SIZE_ONLY:
        fail("v", f"backend {backend!r} needs values of the keys' head size D={D}, got Dv={Dv} (MLA); use "
                  "backend='auto', 'sdpa', 'cpu' or 'torch'")
    if backend == "auto" and device.type != "cpu":
        return "sdpa" if not softcap and sinks is None else "torch"
    return backend


def _check(q, k, v, prefix_lens, tree_mask, window, softcap, sinks) -> None:
    check_tensor("q", q, 4, FLOAT_TYPES)
    check_tensor("k", k, 4, (q.dtype,), q.device)
    check_tensor("v", v, 4, (q.dtype,), q.device)
    B, Hq, T, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        fail("k", f"expected [B={B}, Hkv, S, D={D}], got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        fail("v", f"expected [B, Hkv, S] = {tuple(k.shape[:3])} like k, then any head size Dv, got {tuple(v.shape)}")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        fail("k", f"query heads ({Hq}) must be a multiple of key/value heads ({k.shape[1]})")
    check_tensor("prefix_lens", prefix_lens, 1, (torch.int32, torch.int64), q.device)
    check_shape("prefix_lens", prefix_lens, (B,))
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, 3, (torch.int32,), q.device)
        if tree_mask.shape[0] not in (1, B) or tree_mask.shape[1] != T or tree_mask.shape[2] * 32 < T:
            fail("tree_mask", f"expected [B={B} or 1, T={T}, W>={(T + 31) // 32}], got {tuple(tree_mask.shape)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        fail("window", f"expected None or an int >= 1, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not math.isfinite(softcap) or softcap <= 0):
        fail("softcap", f"expected None or a finite float > 0, got {softcap!r}")
    if sinks is not None:
        check_tensor("sinks", sinks, 1, FLOAT_TYPES, q.device)
        check_shape("sinks", sinks, (Hq,))
    if B and (bool((prefix_lens < 0).any()) or bool((prefix_lens + T > k.shape[2]).any())):
        fail("prefix_lens", f"need 0 <= prefix_lens and prefix_lens + T ({T}) <= S ({k.shape[2]}); "
                            f"got {prefix_lens.tolist()}")
