"""A lean forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over a SpecCache.

It does the transformers modules' arithmetic op for op (the logits equal the HF forward's
bit for bit; tests/test_lean.py checks it), without their per-call machinery: no mask
building, no output capture, no keyword plumbing, no module calls, and the rotary cos/sin
read from a table. At draft-model sizes that machinery costs as much as the matmuls (see
``benchmarks/results/lean_forward_cpu.csv``). A model whose modules this file does not know
(other classes, a dynamic RoPE, forward hooks or a patched forward, as offloading and
quantization libraries install) is left to the HF forward. The choice is made once per
generate call, by :func:`prepare` (``spec_ext.models.hf.attention_implementation`` calls it).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module
from torch import Tensor

from spec_ext import ops
from spec_ext.models.cache import split_size
from spec_ext.ops.attention import invariant_attention
from spec_ext.ops.linear import auto_linear, invariant_linear, kernel_applies

_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@functools.lru_cache(None)
def _known_layer_classes() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    families = (llama, mistral, qwen2, qwen3)
    prefix = {llama: "Llama", mistral: "Mistral", qwen2: "Qwen2", qwen3: "Qwen3"}
    return tuple(tuple(getattr(m, prefix[m] + name) for m in families)
                 for name in ("DecoderLayer", "Attention", "MLP", "RMSNorm"))


def _window(attention) -> int | None:
    """The ``sliding_window`` the module passes its attention function: Mistral's is its
    config's, Qwen2's and Qwen3's the layer's own (None on full-attention layers)."""
    from transformers.models.mistral.modeling_mistral import MistralAttention

    if isinstance(attention, MistralAttention):
        return getattr(attention.config, "sliding_window", None)
    return getattr(attention, "sliding_window", None)


def _hooked(module) -> bool:
    """A forward hook or a patched forward, other than the output-capturing hooks that
    transformers itself leaves on its layers (inactive outside its own forward) and the
    skinny_linear forward an open block of ``hf.attention_implementation`` gave a linear layer."""
    hooks = list(module._forward_hooks.values()) + list(module._forward_pre_hooks.values())
    foreign = [h for h in hooks if getattr(h, "__module__", None) != "transformers.utils.output_capturing"]
    forward = module.__dict__.get("forward")
    return bool(foreign) or (forward is not None and not getattr(forward, "spec_ext_linear", False))


_FORCED: "weakref.WeakSet" = weakref.WeakSet()


@contextlib.contextmanager
def hf_modules(*models):
    """While inside, generate calls run ``models`` on the HF modules even where the lean
    forward applies (to compare the two paths, or to rule the lean one out).

    Example:
        >>> with hf_modules(target, draft):                                 # doctest: +SKIP
        ...     spec_ext.generate(target, draft, ids)
    """
    added = [m for m in models if m not in _FORCED]
    _FORCED.update(added)
    try:
        yield
    finally:
        for m in added:
            _FORCED.discard(m)


def why_not_lean(model) -> str | None:
    """Why the lean forward cannot reproduce ``model`` (so it takes the HF modules), or None
    when it can. Whether spec_ext decodes ``model`` at all is another question:
    :func:`spec_ext.models.hf.unsupported_reason`."""
    if model in _FORCED:
        return "forced onto the HF modules (spec_ext.models.hf_modules)"
    layers, attentions, mlps, norms = _known_layer_classes()
    if split_size(model) > 1:
        return f"split across {split_size(model)} ranks by tensor parallelism (the transformers modules run the shards)"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        return "not a *ForCausalLM with .model.layers and .lm_head"
    rope = getattr(model.config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in _STATIC_ROPE:
        return f"rope_type {rope.get('rope_type')!r} changes with the sequence length"
    hooked = [name or "the model" for name, m in model.named_modules() if _hooked(m)]
    if hooked:
        return f"forward hooks or a patched forward on {hooked[0]}"
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "global module forward hooks"
    for layer in base.layers:
        if (type(layer) not in layers or type(layer.self_attn) not in attentions or type(layer.mlp) not in mlps
                or type(layer.input_layernorm) not in norms or type(layer.post_attention_layernorm) not in norms):
            return f"unknown layer modules in {type(layer).__name__}"
        head_norms = [getattr(layer.self_attn, n, None) for n in ("q_norm", "k_norm")]
        if any(n is not None and type(n) not in norms for n in head_norms):
            return f"unknown q/k norms in {type(layer.self_attn).__name__}"
    if type(base.norm) not in norms:
        return "unknown final norm"
    return None


def _linear(module) -> tuple[Tensor, Tensor | None]:
    return module.weight, module.bias


def _norm(module) -> tuple[Tensor, float]:
    return module.weight, module.variance_epsilon


def _head_norm(attention, name: str) -> tuple[Tensor, float] | None:
    """Qwen3's RMSNorm over each head's dims of q or k (before the rotary), or None."""
    module = getattr(attention, name, None)
    return None if module is None else _norm(module)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    dtype = x.dtype
    if dtype != torch.float32:  # the casts are no-ops in float32 but still cost a call each
        x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x if dtype == torch.float32 else x.to(dtype))


def per_position(act, x: Tensor) -> Tensor:
    """``act(x)`` computed one position (a row of x's last dim) at a time: an elementwise
    function with a transcendental (SiLU's exp) takes a vectorised exp on most elements and
    the C library's on the few past the last whole vector of the call (and of each thread's
    share), so on [T, I] at once an element's bits depend on T (float32 SiLU, I = 48: rows
    of T = 2..64 differ from the same rows alone); row by row, every row is the same call."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        return act(x)
    return torch.stack([act(row) for row in rows.unbind(0)]).view(x.shape)


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` in 4 ops instead of 7, with the same
    roundings: rotate_half(x) = cat(-x2, x1) and -x2 * s == x2 * -s exactly, so the sign
    moves into the table and the halves swap with one roll."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class LeanDecoder:
    """The forward of one Llama-family model, reading its parameters in place (so later
    in-place weight updates are seen; replacing modules needs a new LeanDecoder).
    ``fast_linear``: the linear layers take :func:`spec_ext.ops.skinny_linear` (CPU,
    float32, AVX2 + FMA or AVX-512, where ``spec_ext.ops.linear.uses_kernel`` says it is faster:
    up to 16 token rows, 32 for large weights with short rows; equal to F.linear up to float32
    rounding, so no longer bit-equal to the HF forward).

    ``invariant`` (docs/invariance.md): a position's logits (and hidden states, features) are
    the same bits whether the forward feeds it alone or with other positions (a verification
    block of k+1, a tree, a prefill), in float32, bfloat16 and float16: every linear layer
    (the projections, the LM head) is :func:`spec_ext.ops.invariant_linear` at every row
    count, the attention :func:`spec_ext.ops.tree_attention` with ``invariant=True``, the
    MLP's activation is applied one position at a time (:func:`per_position`); the rest is
    per position already (embedding, RMSNorm's float32 mean over one position's features,
    the rotary's elementwise products from a table, residual adds). So greedy decoding with
    verification blocks picks the tokens one-token-at-a-time decoding picks. Not bit-equal to
    the HF forward (its F.linear and attention are not invariant); within float rounding of it.
    ValueError where there is no invariant linear (CPU without the built extension). Takes
    precedence over ``fast_linear``."""

    def __init__(self, model, fast_linear: bool = False, invariant: bool = False):
        base = model.model
        self.model = weakref.ref(model)
        self.embed = base.embed_tokens.weight
        self.layers = []
        for layer in base.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(dict(
                input_norm=_norm(layer.input_layernorm), post_norm=_norm(layer.post_attention_layernorm),
                q=_linear(attn.q_proj), k=_linear(attn.k_proj), v=_linear(attn.v_proj), o=_linear(attn.o_proj),
                gate=_linear(mlp.gate_proj), up=_linear(mlp.up_proj), down=_linear(mlp.down_proj),
                act=mlp.act_fn, head_dim=attn.head_dim, scaling=attn.scaling, window=_window(attn),
                q_norm=_head_norm(attn, "q_norm"), k_norm=_head_norm(attn, "k_norm")))
        self.norm = _norm(base.norm)
        self.lm_head = _linear(model.lm_head)
        self.invariant = bool(invariant)
        self.fast_linear = fast_linear and kernel_applies(model.device, model.dtype) and not self.invariant
        self.attention = functools.partial(ops.tree_attention, validate=False, invariant=self.invariant)
        if self.invariant:  # refused here, by name, rather than at the first forward
            invariant_linear(model.device, model.dtype)
            invariant_attention(model.device)
        self._rope: tuple[Tensor, Tensor] | None = None

    @property
    def linear(self):
        """The linear layers' function for a forward: F.linear, with ``fast_linear`` what
        skinny_linear's auto rule runs, with ``invariant`` the invariant linear (taken once
        per forward, not per layer)."""
        if self.invariant:
            return invariant_linear(self.embed.device, self.embed.dtype)
        return auto_linear(self.embed.device, self.embed.dtype) if self.fast_linear else F.linear

    def _rotary(self, positions: Tensor, dtype: torch.dtype, capacity: int) -> tuple[Tensor, Tensor]:
        """cos, signed sin [B,1,T,D] for ``positions`` [B,T] (each below the cache's
        ``capacity``), from a table of what the model's own rotary module returns, made once
        per capacity (no read of the positions on the host); the sin's first half is negated
        (see :func:`_rotate`)."""
        table = self._rope
        if table is None or table[0].shape[0] < capacity or table[0].dtype != dtype or \
                table[0].device != positions.device:
            probe = torch.empty(0, dtype=dtype, device=positions.device)
            cos, sin = self.model().model.rotary_emb(probe, torch.arange(capacity, device=positions.device)[None])
            half = sin.shape[-1] // 2
            table = self._rope = (cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1))
        return table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)

    def __call__(self, input_ids: Tensor, cache, positions: Tensor, tree_mask: Tensor | None = None,
                 hidden: bool = False, layers: tuple[int, ...] | None = None, logits_at: Tensor | None = None):
        """logits [B,T,V] float32 (with ``logits_at`` [B,n] int64: at those columns alone,
        [B,n,V]); with ``hidden`` also the last hidden state (after the final norm); with ``layers`` (checked by the caller: ints in 0..L) also the features
        [B,T,len(layers)*H]: hidden state k is the input of layer k (k=0: the embeddings),
        L the output of the final norm, as HF's ``hidden_states[k]``. Returns logits,
        (logits, hidden), (logits, features) or (logits, hidden, features)."""
        B, T = input_ids.shape
        linear = self.linear
        x = F.embedding(input_ids, self.embed)
        cos, signed_sin = self._rotary(positions, x.dtype, cache.capacity)
        # hidden state k -> its tensor: a reference is enough, the residual stream is never changed in place
        kept = None if layers is None else {}
        for index, layer in enumerate(self.layers):
            if kept is not None and index in layers:
                kept[index] = x
            h = _rms_norm(x, *layer["input_norm"])
            shape = (B, T, -1, layer["head_dim"])
            q, k = linear(h, *layer["q"]).view(shape), linear(h, *layer["k"]).view(shape)
            if layer["q_norm"] is not None:
                q, k = _rms_norm(q, *layer["q_norm"]), _rms_norm(k, *layer["k_norm"])
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = linear(h, *layer["v"]).view(shape).transpose(1, 2)
            q, k = _rotate(q, cos, signed_sin), _rotate(k, cos, signed_sin)
            keys, values = cache.update(k, v, index)
            a = self.attention(q, keys, values, cache.lengths, tree_mask, layer["scaling"], layer["window"])
            x = x + linear(a.transpose(1, 2).reshape(B, T, -1), *layer["o"])
            h = _rms_norm(x, *layer["post_norm"])
            gate = linear(h, *layer["gate"])
            gate = per_position(layer["act"], gate) if self.invariant else layer["act"](gate)
            x = x + linear(gate * linear(h, *layer["up"]), *layer["down"])
        x = _rms_norm(x, *self.norm)
        head = x if logits_at is None else x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        logits = linear(head, *self.lm_head).float()
        if kept is None:
            return (logits, x) if hidden else logits
        kept[len(self.layers)] = x
        features = torch.cat([kept[k] for k in layers], -1)
        return (logits, x, features) if hidden else (logits, features)


_DECODERS: "weakref.WeakKeyDictionary[object, LeanDecoder | None]" = weakref.WeakKeyDictionary()
_REASONS: "weakref.WeakKeyDictionary[object, str | None]" = weakref.WeakKeyDictionary()


def prepare(model, fast_linear: bool | str = False, invariant: bool = False) -> None:
    """Decide (again) whether ``model`` takes the lean forward: its modules, hooks and
    weights may have changed since the last generate call. ``fast_linear``: see
    :class:`LeanDecoder` (a model left to the HF modules gets the same per call rule from
    ``hf.attention_implementation``, on its ``nn.Linear`` layers); True warns when it cannot
    apply, "auto" (generate's default for target and draft) applies it silently where it can,
    layer by layer where ``uses_kernel`` says it is faster; False: F.linear, HF's own arithmetic.
    ``invariant``: see :class:`LeanDecoder` (a model left to the HF modules is not made
    invariant here: ``spec_ext.models.hf`` routes its modules)."""
    if fast_linear not in (False, True, "auto"):
        raise ValueError(f"fast_linear: expected False, True or 'auto', got {fast_linear!r}")
    if not isinstance(invariant, bool):
        raise ValueError(f"invariant: expected True or False, got {invariant!r}")
    reason = _REASONS[model] = why_not_lean(model)
    _DECODERS[model] = None if reason else LeanDecoder(model, bool(fast_linear), invariant)
    if fast_linear is not True:
        return
    why = None
    if not kernel_applies(model.device, model.dtype):
        why = "skinny_linear's kernel runs on CPU float32 models, on x86-64 with AVX2 and FMA or AVX-512"
    elif split_size(model) > 1:  # hf.attention_implementation leaves a split model's shards on F.linear
        why = reason
    if why:
        warnings.warn(f"fast_linear: no effect on this {type(model).__name__} ({model.dtype}, {model.device}): {why}",
                      stacklevel=3)


def decision(model) -> tuple[LeanDecoder | None, str | None]:
    """What the last :func:`prepare` decided for ``model`` (its decoder and reason), to hand
    back to :func:`restore` when a nested block that prepared it again closes."""
    return _DECODERS.get(model), _REASONS.get(model)


def restore(model, decided: tuple[LeanDecoder | None, str | None]) -> None:
    """Make ``decided`` (from :func:`decision`) the current decision for ``model`` again."""
    _DECODERS[model], _REASONS[model] = decided


def lean_decoder(model) -> LeanDecoder | None:
    """The decoder :func:`prepare` made for ``model``, or None: the HF forward."""
    return None if model.training else _DECODERS.get(model)  # dropout: the HF forward applies it


def last_reason(model) -> str | None:
    """Why the last :func:`prepare` left ``model`` to the HF forward (None: it takes the
    lean one, or was never prepared); a model in train mode takes the HF forward too."""
    if model.training and _DECODERS.get(model) is not None:
        return "in train mode (the HF modules apply dropout)"
    return _REASONS.get(model)
