"""Everything that touches transformers internals, in one place.

A forward of an unmodified HF decoder runs through spec_ext by
  * a :class:`SpecCache` passed as the model's cache (writes at per-row offsets),
  * per-row ``position_ids`` [B,T] (prefix length + node depth),
  * a 4-D ``attention_mask`` that carries the packed tree bits [B|1,1,T,W] int32 (a 4-D
    mask is handed to every layer's attention function untouched, whatever the layer's
    type, so transformers builds no mask; the attention function checks that it got it),
  * the attention function ``"spec_ext"``, registered with ``AttentionInterface``, that
    calls :func:`spec_ext.ops.tree_attention` with the cache's per-row prefix lengths and
    the layer's own ``scaling``, ``sliding_window`` (as ``window``), ``softcap`` and
    ``s_aux`` (as ``sinks``).
Which decoders qualify: any decoder-only causal LM whose attention layers call the
attention interface (transformers' ``_supports_attention_backend``) and whose forward
takes a cache; :func:`unsupported_reason` says why any other is refused. Models
:mod:`spec_ext.models.lean` reproduces (Llama, Mistral, Qwen2, Qwen3 without hooks) skip the
HF modules and run the same arithmetic there (:func:`forward_path` says which path a model
takes).

Vocabularies that differ by padding (one tokenizer, e.g. Qwen2.5-0.5B's 151936 rows
drafting for Qwen2.5-7B's 152064): inside :func:`attention_implementation` with
``vocab_size=V``, :func:`forward` returns every model's logits with V columns (columns a
model lacks get the lowest float, so probability 0; extra columns are dropped) and feeds a
model a placeholder id for a token it cannot embed.

Width invariance (``attention_implementation(..., invariant=True)``, docs/invariance.md): a
position's logits are the same bits whatever else the forward computes. The lean forward does
it itself; on the HF modules the forward runs under :class:`_Invariant`, a torch function
mode of its thread that puts every linear product on :func:`spec_ext.ops.invariant_linear`
and applies elementwise transcendentals one position at a time (they take a vectorised and a
scalar path by where an element falls in the call), and the attention takes its invariant
path.

Features for draft heads that read the target's hidden states (EAGLE-3): ``forward(...,
layers=(k, ...)).features`` is the concatenation of HF's ``hidden_states[k]`` of those
layers, from the same forward (the lean one keeps them as its layer loop passes them; the HF
modules are asked for those entries only); :func:`aux_layer_ids` picks vLLM's three.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
import weakref
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

from spec_ext import ops
from spec_ext.models import lean
from spec_ext.models.cache import split_size
from spec_ext.ops.attention import invariant_attention
from spec_ext.ops.checks import FLOAT_TYPES
from spec_ext.ops.linear import invariant_linear, kernel_applies

ATTENTION = "spec_ext"

__all__ = ["ATTENTION", "Forward", "attention_implementation", "aux_layer_ids", "check_model", "check_pair", "forward",
           "forward_path", "num_layers", "unsupported_reason"]

# keyword arguments models pass to the attention function that do not change what it computes
_PASSIVE = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
                      "output_router_logits"})
# layer kinds (config.layer_types) the attention applies exactly; the rest are refused by name
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
_RECURRENT_LAYERS = ("linear_attention", "mamba", "conv", "recurrent", "rwkv", "lstm", "ssm", "hybrid")


def _attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, dropout=0.0,
               sliding_window=None, softcap=None, s_aux=None, is_causal=None,
               spec_prefix_lens: Tensor | None = None, **kwargs):
    if spec_prefix_lens is None:
        raise RuntimeError("the 'spec_ext' attention runs only inside spec_ext.models.hf.forward "
                           "(it needs per-row prefix lengths)")
    name = type(module).__name__
    if dropout:
        raise ValueError(f"{name}: dropout={dropout} (the model is in train mode): spec_ext's attention applies "
                         "no dropout; call model.eval()")
    if is_causal is False:
        raise ValueError(f"{name}: is_causal=False: spec_ext's attention is causal (or a draft tree)")
    if kwargs.keys() - _PASSIVE:  # a set difference per layer; the names are sorted only to refuse one
        active = sorted(n for n in kwargs.keys() - _PASSIVE if kwargs[n] is not None)
        if active:
            raise ValueError(f"{name}: the attention argument {active[0]!r} is not supported by spec_ext (it "
                             "would be dropped); use a model without it")
    if not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.int32:
        raise RuntimeError(f"{name}: got a mask transformers built ({type(attention_mask).__name__}) instead of "
                           "spec_ext's packed tree bits")
    tree_mask = attention_mask[:, 0] if attention_mask.shape[-1] else None
    out = ops.tree_attention(query, key, value, spec_prefix_lens, tree_mask, scale=scaling, window=sliding_window,
                             softcap=softcap, sinks=s_aux, validate=False, invariant=_invariant_here())
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, _attention)


@functools.lru_cache(None)
def _cache_argument(model_class) -> str | None:
    parameters = inspect.signature(model_class.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


@functools.lru_cache(None)
def _keeps_logits(model_class) -> bool:
    """Whether the model's forward computes the logits at the columns ``logits_to_keep`` alone."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def unsupported_reason(model) -> str | None:
    """Why spec_ext cannot decode ``model`` exactly, or None when it can (on the HF modules
    at least). Checked before any forward; an attention argument this cannot see from
    outside (an unknown keyword a layer passes) is refused by name at the first forward."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "forward"):
        return "not a transformers model (no .config)"
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model (spec_ext drafts for decoder-only causal LMs)"
    layer_types = list(getattr(config, "layer_types", None) or [])
    recurrent = [t for t in layer_types if any(word in str(t) for word in _RECURRENT_LAYERS)]
    if getattr(model, "_is_stateful", False) or recurrent:
        kind = f" ({recurrent[0]!r} layers)" if recurrent else ""
        return (f"recurrent or state-space layers{kind}: their state cannot be rolled back to a row's accepted "
                "tokens")
    unknown = [t for t in layer_types if t not in _ATTENTION_LAYERS]
    if unknown:
        return f"layer type {unknown[0]!r}: spec_ext's attention applies full and sliding-window layers only"
    if _cache_argument(type(model)) is None:
        return "its forward takes no cache (no 'cache' or 'past_key_values' argument)"
    if not getattr(model, "_supports_attention_backend", False):
        return "its attention layers do not call transformers' attention interface"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True (is_causal=False): spec_ext's attention is causal"
    for module_name, module in model.named_modules():
        if getattr(module, "is_causal", True) is False and hasattr(module, "layer_idx"):
            return f"{module_name} has is_causal=False: spec_ext's attention is causal"
    return None


def check_model(model, role: str) -> None:
    """ValueError naming ``role`` and the reason when :func:`unsupported_reason` refuses ``model``."""
    reason = unsupported_reason(model)
    if reason is not None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(f"{role}: {type(model).__name__} (model_type {model_type!r}) is not supported: {reason}")


def check_pair(target, draft) -> None:
    """Both models supported, on one device. Their vocabulary sizes may differ (padding of
    one tokenizer's embedding table): see the module docstring."""
    check_model(target, "target")
    check_model(draft, "draft")
    if target.device != draft.device:
        raise ValueError(f"draft: on {draft.device} but the target is on {target.device}")


def _text_config_value(model, name: str):
    """``model.config.<name>``, or its text config's where a multimodal config keeps it there."""
    config = model.config
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), name, None)
    if value is None:
        raise ValueError(f"{type(model).__name__}: its config names no {name} (nor its text_config)")
    return value


def vocabulary_size(model) -> int:
    """The size of ``model``'s vocabulary (its config's, or its text config's)."""
    return _text_config_value(model, "vocab_size")


def num_layers(model) -> int:
    """L, the number of decoder layers of ``model`` (its config's ``num_hidden_layers``, or
    its text config's): HF's ``hidden_states`` has L + 1 entries."""
    return _text_config_value(model, "num_hidden_layers")


def aux_layer_ids(model) -> tuple[int, int, int]:
    """The three hidden states an EAGLE-3 head reads, as vLLM picks them for a target of L
    decoder layers: ``(2, L // 2, L - 3)``, each the input of that layer (HF's
    ``hidden_states[k]``; pass them to :func:`forward` as ``layers``). For L >= 4 that is
    vLLM's choice as is (e.g. L=32: (2, 16, 29); L=4: (2, 2, 1)). Below 4 layers some of
    those ids name no layer, so each is clamped into 0..L-1 (a layer's input, never the
    final norm's output): L=3: (2, 1, 0), L=2: (1, 1, 0), L=1: (0, 0, 0). A head trained
    with other ids (``eagle_aux_hidden_state_layer_ids`` in its config) should use those."""
    count = num_layers(model)
    if count < 1:
        raise ValueError(f"{type(model).__name__}: {count} decoder layers (aux_layer_ids needs at least 1)")
    return tuple(min(max(k, 0), count - 1) for k in (2, count // 2, count - 3))


def _feature_layers(model, layers) -> tuple[int, ...]:
    """``layers`` as a tuple of hidden-state indices k in 0..L, or ValueError naming the
    first that is not one."""
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise ValueError(f"layers: expected None or a tuple of ints, got {layers!r}")
    layers = tuple(layers)
    count = num_layers(model)
    if not layers:
        raise ValueError("layers: expected None or at least one hidden-state index, got ()")
    for k in layers:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= count:
            raise ValueError(f"layers: {k!r} is not a hidden-state index of this {type(model).__name__} "
                             f"(ints 0..{count}: 0 the embeddings, k the input of layer k, {count} the final norm's "
                             "output)")
    return layers


def _embeddable(model) -> int:
    embeddings = model.get_input_embeddings()
    return getattr(embeddings, "num_embeddings", None) or vocabulary_size(model)


def _placeholder(model, rows: int) -> int:
    pad = getattr(model.config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < rows else 0


def _skinny_forward(module: nn.Linear, x: Tensor) -> Tensor:
    """nn.Linear's forward on :func:`spec_ext.ops.skinny_linear` (backend auto: the kernel
    where its measured rule says it is faster, F.linear elsewhere), for the HF modules of a
    model inside a block with ``fast_linear`` opened on this thread (another thread's calls
    of the same module keep F.linear; an invariant forward's F.linear is the invariant one).
    The kernel has no backward and ignores autocast, so a forward that records gradients or
    runs under CPU autocast keeps F.linear."""
    if (torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or _invariant_here()
            or not _routes_here(_ROUTED_OWNER.get(module))):
        return F.linear(x, module.weight, module.bias)
    return ops.skinny_linear(x, module.weight, module.bias, validate=False)


_skinny_forward.spec_ext_linear = True  # lean._hooked: this replaced forward is not a user's patch

# elementwise functions whose vectorised and scalar paths round differently (a transcendental)
_TRANSCENDENTAL = frozenset(
    getattr(owner, name) for owner in (torch, Tensor, F, torch.special) for name in (
        "exp", "exp_", "expm1", "exp2", "log", "log1p", "log2", "sigmoid", "sigmoid_", "tanh", "tanh_", "sin", "cos",
        "erf", "erfc", "silu", "gelu", "softplus", "mish", "logsigmoid", "selu", "elu", "celu", "hardswish", "expit",
        "sinh", "cosh", "atan", "asin", "acos") if hasattr(owner, name))


_GROUPED_MM = frozenset(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f)


def _grouped_linear(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """grouped_mm(a [S,K], b [E,K,N], offs [E] group ends) on the invariant linear, group by
    group (rows past the last group are zero)."""
    linear = invariant_linear(a.device, a.dtype)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for group, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = linear(a[start:end], b[group].t().contiguous(), None)
        start = end
    return out


class _Invariant(torch.overrides.TorchFunctionMode):
    """The HF modules' forward of a model whose block is invariant (a torch function mode: it
    sees this thread's calls only). ``F.linear``, ``torch.addmm`` (GPT-2's Conv1D) and grouped
    products (mixture-of-experts layers) take :func:`spec_ext.ops.invariant_linear`; an
    elementwise transcendental on a tensor of two or more dimensions runs one row of its last
    dimension at a time, so each position's result is the same call whatever else the forward
    holds."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GROUPED_MM and len(args) == 2 and kwargs.get("offs") is not None and args[1].dim() == 3 \
                and kwargs.get("bias") is None and kwargs.get("out_dtype") in (None, args[0].dtype) \
                and args[0].dtype in FLOAT_TYPES:
            return _grouped_linear(args[0], args[1], kwargs["offs"])
        if func is F.linear:
            x, weight, bias = (list(args) + [kwargs.get("weight"), kwargs.get("bias")])[:3] if len(args) < 3 \
                else args
            if x.dtype in FLOAT_TYPES and weight.dtype in FLOAT_TYPES:
                return invariant_linear(x.device, x.dtype)(x, weight.contiguous(), bias)
        elif func is torch.addmm and len(args) == 3 and not kwargs and args[1].dim() == 2:
            bias, x, weight = args  # Conv1D: x @ weight + bias, weight [K, N]
            if x.dtype in FLOAT_TYPES:
                return invariant_linear(x.device, x.dtype)(x, weight.t().contiguous(), bias)
        elif func in _TRANSCENDENTAL and args and isinstance(args[0], Tensor) and args[0].dim() >= 2:
            x = args[0]
            rows = x.reshape(-1, x.shape[-1]) if x.is_contiguous() else None
            if func.__name__.endswith("_"):  # in place, row by row
                for row in (rows if rows is not None else x.view(-1, x.shape[-1])).unbind(0):
                    func(row, *args[1:], **kwargs)
                return x
            return lean.per_position(lambda row: func(row, *args[1:], **kwargs), x)
        return func(*args, **kwargs)

# model -> the nn.Linear modules whose forward a block replaced, each with the bound method
# set. Why a forward set on the instances (not a pre-hook, a function mode or a patched
# class): nothing is installed, so nothing costs, while fast_linear is off or the model is
# lean; a hook cannot replace the computation (it could only redo it); a torch function
# mode would see every op of every thread; and nn.Module.__call__ still runs the user's
# hooks around an instance's forward (torch.compile traces it like any forward). Modules
# that are not exactly nn.Linear (quantized, LoRA, parametrized subclasses), that already
# have a forward of their own (offloading hooks) or whose weight is not float32 on the CPU
# are left alone.
_ROUTED: "weakref.WeakKeyDictionary[object, list[tuple[nn.Linear, object]]]" = weakref.WeakKeyDictionary()
_ROUTED_OWNER: "weakref.WeakKeyDictionary[nn.Linear, object]" = weakref.WeakKeyDictionary()  # module -> its model


def _route_linear(model) -> None:
    """Put the nn.Linear modules of ``model`` on :func:`_skinny_forward` (which takes the
    kernel only on threads whose newest open block for ``model`` routes it). Callers hold
    _OPEN_LOCK."""
    if model in _ROUTED:
        return
    routed = _ROUTED[model] = []  # recorded before each module changes: a failure midway is undone by _unroute
    for module in model.modules():
        if (type(module) is nn.Linear and "forward" not in module.__dict__
                and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32):
            forward = types.MethodType(_skinny_forward, module)
            routed.append((module, forward))
            _ROUTED_OWNER[module] = model
            module.forward = forward


def _unroute_linear(model) -> None:
    """Hand ``model``'s nn.Linear modules back exactly as they were (no forward of their own)."""
    for module, forward in _ROUTED.pop(model, ()):
        if module.__dict__.get("forward") is forward:
            del module.forward
        _ROUTED_OWNER.pop(module, None)


class _Block:
    """What one open :func:`attention_implementation` block set for one model: its padded
    vocabulary entry (or None), the lean forward's decision, whether the HF modules'
    linear layers take skinny_linear (a model on the HF modules with ``fast_linear``) and
    whether its forwards are width-invariant."""

    def __init__(self, vocab: tuple[int, int, int] | None, decided: tuple, route_linear: bool, invariant: bool):
        self.vocab, self.decided, self.route_linear, self.invariant = vocab, decided, route_linear, invariant


# Blocks are per thread: a forward reads the newest block its own thread opened for the model
# (its vocabulary, its lean decision, its linear routing), so calls on several threads with
# one model do not see each other's settings, and a thread with no block open (a plain
# ``model.generate`` beside an accelerated call) sees the model as it was: its configs'
# ``_attn_implementation`` reads "spec_ext" only on threads with a block open (the configs'
# class is swapped, while any block is open, for one whose property asks the thread).
_HERE = threading.local()  # .blocks: {id(model): [its blocks on this thread, oldest first]}
# model -> (its configs, their classes before the first open block, open blocks on all threads)
_OPEN: "weakref.WeakKeyDictionary[object, list]" = weakref.WeakKeyDictionary()
_OPEN_LOCK = threading.Lock()


def _here() -> dict:
    blocks = getattr(_HERE, "blocks", None)
    if blocks is None:
        blocks = _HERE.blocks = {}
    return blocks


def _block_here(model) -> _Block | None:
    """The newest block this thread opened for ``model`` (None: none open here)."""
    blocks = getattr(_HERE, "blocks", None)
    found = blocks.get(id(model)) if blocks else None
    return found[-1] if found else None


def _routes_here(model) -> bool:
    block = None if model is None else _block_here(model)
    return block is not None and block.route_linear


def _invariant_here() -> bool:
    """Whether this thread is inside :func:`forward` of a model whose block is invariant."""
    return getattr(_HERE, "invariant", False)


def _configs(model) -> list:
    """``model.config`` and every sub-config under it (a multimodal model's text config)."""
    found, todo = [], [model.config]
    while todo:
        config = todo.pop()
        if any(config is c for c in found):
            continue
        found.append(config)
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation"):
                todo.append(sub)
    return found


@functools.lru_cache(None)
def _routed_config_class(cls):
    """``cls`` with an ``_attn_implementation`` that reads "spec_ext" on a thread that has a
    block open for a model of this config, and the stored value on any other thread."""
    stored = cls._attn_implementation

    def read(self):
        configs = getattr(_HERE, "configs", None)
        return ATTENTION if configs and configs.get(id(self)) else stored.fget(self)

    return type(cls.__name__, (cls,), {"_attn_implementation": property(read, stored.fset),
                                        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                        "spec_ext_routed": True})


def _enter_configs(configs: list, step: int) -> None:
    counts = getattr(_HERE, "configs", None)
    if counts is None:
        counts = _HERE.configs = {}
    for config in configs:
        counts[id(config)] = counts.get(id(config), 0) + step
        if counts[id(config)] <= 0:
            del counts[id(config)]


_ATTENDING: "weakref.WeakKeyDictionary[object, list]" = weakref.WeakKeyDictionary()  # module -> its configs


def _route_configs(configs: list) -> None:
    """Swap each config's class for one whose ``_attn_implementation`` asks the thread."""
    for config in configs:
        if not getattr(type(config), "spec_ext_routed", False):
            config.__class__ = _routed_config_class(type(config))


@contextlib.contextmanager
def routed_attention(module):
    """While inside, ``module``'s attention layers (its config's and sub-configs'
    ``_attn_implementation``) go through spec_ext's attention function on this thread alone;
    other threads' forwards of it run as they would without. For a module spec_ext made that
    :func:`attention_implementation` does not prepare (a checkpoint's MTP layers, entered once
    per layer step): its configs keep the swapped class after the last block closes (a thread
    with none open reads the stored value), so a block costs no set-up."""
    configs = _ATTENDING.get(module)
    if configs is None:
        with _OPEN_LOCK:
            configs = _ATTENDING.get(module)
            if configs is None:
                configs = _configs(module)
                _route_configs(configs)
                _ATTENDING[module] = configs
    _enter_configs(configs, +1)
    try:
        yield
    finally:
        _enter_configs(configs, -1)


def _close(opened: list[tuple[object, _Block]]) -> None:
    here = _here()
    with _OPEN_LOCK:
        for m, block in reversed(opened):
            entry = _OPEN[m]
            configs, classes, count = entry
            mine = here[id(m)]
            mine.remove(block)  # by identity: _Block has no __eq__
            if mine:  # forward_path and lean_decoder report this thread's enclosing block again
                lean.restore(m, mine[-1].decided)
            else:
                del here[id(m)]
            _enter_configs(configs, -1)
            entry[2] = count - 1
            if entry[2] == 0:
                del _OPEN[m]
                for config, cls in zip(configs, classes):
                    config.__class__ = cls
                _unroute_linear(m)


@contextlib.contextmanager
def attention_implementation(*models, fast_linear: bool | str | Sequence[bool | str] = False,
                             vocab_size: int | None = None, invariant: bool | Sequence[bool] = False):
    """Route the models' attention through spec_ext for the duration of the block, on this
    thread (and choose, per model, between the lean forward and the HF modules; ``fast_linear``, one
    for all models or one per model: see :func:`spec_ext.models.lean.prepare`; True or
    "auto" on a model that takes the HF modules puts their ``nn.Linear`` layers (the decoder
    layers' projections, the LM head) on :func:`spec_ext.ops.skinny_linear` with backend
    auto for the block, and hands them back unchanged when the model's last block closes;
    False: HF's own arithmetic).
    ``vocab_size``: :func:`forward` returns logits [B,T,vocab_size] for every model (the
    target's V; see the module docstring); None: each model's own. ``invariant``, one for all
    models or one per model: the model's forwards are width-invariant (the module docstring;
    docs/invariance.md); ValueError where there is no invariant kernel for its device and dtype.

    Blocks nest, with the same model too, and are per thread: inside, the newest block this
    thread opened sets a model's forward; when it closes, the one this thread opened before
    it applies again. Other threads see none of it: their forwards of the same model (a
    plain ``model.generate`` beside an accelerated call, or another accelerated call with
    other settings) run as they would without this block. When a model's last block on any
    thread closes, the model is handed back exactly as it was."""
    fast = list(fast_linear) if isinstance(fast_linear, (list, tuple)) else [fast_linear] * len(models)
    if len(fast) != len(models):
        raise ValueError(f"fast_linear: {len(fast)} settings for {len(models)} models")
    invariants = list(invariant) if isinstance(invariant, (list, tuple)) else [invariant] * len(models)
    if len(invariants) != len(models) or not all(isinstance(i, bool) for i in invariants):
        raise ValueError(f"invariant: expected True or False, or one per model ({len(models)}), got {invariant!r}")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab_size: expected None or a positive int, got {vocab_size!r}")
    opened: list[tuple[object, _Block]] = []
    here = _here()
    try:
        with _OPEN_LOCK:
            for m, f, inv in zip(models, fast, invariants):
                lean.prepare(m, f, invariant=inv)
                rows = _embeddable(m)
                padded = vocab_size is not None and (rows < vocab_size or vocabulary_size(m) != vocab_size)
                decided = lean.decision(m)
                if inv and decided[0] is None:  # (the lean decoder checked its own)
                    invariant_linear(m.device, m.dtype)  # refused by name where there is no kernel
                    invariant_attention(m.device)
                # a tensor-parallel target's shards keep F.linear: its weights may be DTensors
                route = bool(f) and decided[0] is None and split_size(m) == 1 and kernel_applies(m.device, m.dtype)
                block = _Block((rows, _placeholder(m, rows), vocab_size) if padded else None, decided, route,
                               inv and decided[0] is None)
                entry = _OPEN.get(m)
                if entry is None:
                    configs = _configs(m)
                    entry = _OPEN[m] = [configs, [type(c) for c in configs], 0]
                    _route_configs(configs)
                entry[2] += 1
                here.setdefault(id(m), []).append(block)
                opened.append((m, block))  # before anything else: _close undoes whatever got done
                _enter_configs(entry[0], +1)
                if route:
                    _route_linear(m)
        yield
    finally:
        _close(opened)


def forward_path(model) -> str:
    """Which forward :func:`forward` runs for ``model`` in the current (or the last)
    :func:`attention_implementation` block: ``"lean"``, or ``"hf: <why not lean>"``.

    Example:
        >>> spec_ext.generate(target, draft, ids); forward_path(target)     # doctest: +SKIP
        'hf: unknown layer modules in Gemma2DecoderLayer'
    """
    if lean.lean_decoder(model) is not None:
        return "lean"
    return f"hf: {lean.last_reason(model) or 'not prepared (outside attention_implementation)'}"


def _fit_vocab(logits: Tensor, size: int) -> Tensor:
    """logits [B,T,V'] -> [B,T,size]: extra columns dropped, missing ones the lowest float
    (probability exactly 0 after softmax, never an argmax, finite for the prompt check)."""
    have = logits.shape[-1]
    if have >= size:
        return logits[..., :size]
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], size - have), torch.finfo(logits.dtype).min)], -1)


_NO_TREE = {}


class Forward(NamedTuple):
    """What :func:`forward` returns: ``logits`` [B,T,V] float32 ([B,n,V] at ``logits_at``); ``hidden`` [B,T,H] the last
    hidden state (after the final norm), where asked; ``features`` [B,T,len(layers)*H] the
    hidden states of the layers asked for, in the model's dtype."""
    logits: Tensor
    hidden: Tensor | None = None
    features: Tensor | None = None


def forward(model, input_ids: Tensor, cache, positions: Tensor, tree_mask: Tensor | None = None,
            hidden: bool = False, use_lean: bool = True, layers: Sequence[int] | None = None,
            logits_at: Tensor | None = None) -> Forward:
    """One forward of T new tokens per row over ``cache`` (prefix lengths ``cache.lengths``).

    input_ids [B,T], positions [B,T], tree_mask [B|1,T,W] int32 or None (causal).
    Returns a :class:`Forward`: logits [B,T,V] (float32; V: the ``vocab_size`` of the
    enclosing :func:`attention_implementation`, else the model's); with ``hidden``, the last
    hidden state [B,T,H] (after the final norm); with ``layers`` (a tuple of hidden-state
    indices k in 0..L, L decoder layers; see :func:`aux_layer_ids`), the features
    [B,T,len(layers)*H] in the model's dtype: HF's ``hidden_states[k]`` of each k in the
    order given, concatenated (k=0: the embeddings as the first layer gets them; 0 < k < L:
    the output of layer k-1, the input of layer k; L: the final norm's output). With
    ``logits_at`` [B,n] int64 (columns of the T), the logits are computed at those alone:
    [B,n,V] (a prompt's forward needs its last position's; hidden and features stay [B,T,.]).
    Models
    :mod:`spec_ext.models.lean` reproduces take the lean forward (same numbers, less overhead)
    unless ``use_lean`` is False; others go through the HF modules.

    Example:
        >>> out = forward(target, ids, cache, positions, layers=aux_layer_ids(target))  # doctest: +SKIP
        >>> out.logits.shape, out.features.shape                                       # doctest: +SKIP
    """
    if layers is not None:
        layers = _feature_layers(model, layers)
    block = _block_here(model)
    vocab = None if block is None else block.vocab
    if vocab is not None:
        input_ids = input_ids.masked_fill(input_ids >= vocab[0], vocab[1])
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None:  # drafts past the limit only give tokens past max_new_tokens: keep them in range
        positions = positions.clamp_max(limit - 1)
    cache.before_forward(input_ids, positions, tree_mask)
    decoder = None if not use_lean or model.training else \
        lean.lean_decoder(model) if block is None else block.decided[0]
    if decoder is not None:
        out = decoder(input_ids, cache, positions, tree_mask, hidden, layers, logits_at)
        out = out if isinstance(out, tuple) else (out,)
        out = Forward(out[0], out[1] if hidden else None, out[-1] if layers is not None else None)
    else:
        if tree_mask is None:
            key = (input_ids.device, input_ids.shape[1])
            if key not in _NO_TREE:
                _NO_TREE[key] = torch.zeros(1, 1, input_ids.shape[1], 0, dtype=torch.int32, device=input_ids.device)
            mask4d = _NO_TREE[key]
        else:
            mask4d = tree_mask.unsqueeze(1)
        count = num_layers(model)
        # only the entries asked for are kept (the others come back None)
        captured = hidden if layers is None else sorted({*layers, count} if hidden else set(layers))
        invariant = block is not None and block.invariant
        if invariant and torch.is_grad_enabled():
            raise RuntimeError(f"{type(model).__name__}: an invariant forward records no gradients (its kernels "
                               f"have no backward); run it under torch.no_grad()")
        # the columns any row asks for, where the model's forward can keep them alone (a split
        # model's followers replay the forward without them: its LM head gathers over the ranks)
        keep, asked = {}, logits_at
        if logits_at is not None and split_size(model) == 1 and _keeps_logits(type(model)):
            keep["logits_to_keep"] = columns = torch.unique(logits_at)
            logits_at = torch.searchsorted(columns, logits_at)
        outer, _HERE.invariant = _invariant_here(), invariant
        try:
            with _Invariant() if invariant else contextlib.nullcontext():
                result = model(input_ids=input_ids, position_ids=positions, attention_mask=mask4d, use_cache=True,
                               output_hidden_states=captured, spec_prefix_lens=cache.lengths,
                               **{_cache_argument(type(model)): cache}, **keep)
        finally:
            _HERE.invariant = outer
        logits = result.logits
        if keep and logits.shape[1] != len(keep["logits_to_keep"]):  # a forward that computed them all
            logits_at = asked
        if logits_at is not None:
            logits = logits.gather(1, logits_at[..., None].expand(-1, -1, logits.shape[-1]))
        out = Forward(logits.float(), result.hidden_states[-1] if hidden else None,
                      None if layers is None else _features(model, result.hidden_states, layers, count))
    return out if vocab is None else out._replace(logits=_fit_vocab(out.logits, vocab[2]))


def _features(model, states: tuple, layers: tuple[int, ...], count: int) -> Tensor:
    """The HF modules' ``hidden_states`` entries ``layers``, concatenated."""
    if len(states) != count + 1 or any(states[k] is None for k in layers):
        raise RuntimeError(f"{type(model).__name__}: its forward returned {len(states)} hidden states, not "
                           f"num_hidden_layers + 1 = {count + 1} with the entries {sorted(set(layers))} asked for: "
                           "spec_ext cannot tell which layers they come from")
    return torch.cat([states[k] for k in layers], -1)
