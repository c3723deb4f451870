"""Everything that touches transformers internals, in one place.

A forward of an unmodified HF decoder runs through spec_ext by
  * a :class:`SpecCache` passed as the model's cache (writes at per-row offsets),
  * per-row ``position_ids`` [B,T] (prefix length + node depth),
  * a 4-D ``attention_mask`` that carries the packed tree bits [B|1,1,T,W] int32 (a 4-D
    mask is handed to the attention function untouched, so transformers builds no mask),
  * the attention function ``"spec_ext"``, registered with ``AttentionInterface``, that
    calls :func:`spec_ext.ops.tree_attention` with the cache's per-row prefix lengths.
Models :mod:`spec_ext.models.lean` reproduces (Llama, Mistral, Qwen2 without hooks) skip the HF
modules and run the same arithmetic there.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Sequence

import torch
from torch import Tensor
from transformers import AttentionInterface

from spec_ext import ops
from spec_ext.models import lean

ATTENTION = "spec_ext"
SUPPORTED = ("llama", "qwen2", "mistral")

__all__ = ["ATTENTION", "check_pair", "check_model", "check_window", "forward", "attention_implementation"]


def _attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, dropout=0.0,
               spec_prefix_lens: Tensor | None = None, **kwargs):
    if spec_prefix_lens is None:
        raise RuntimeError("the 'spec_ext' attention runs only inside spec_ext.models.hf.forward "
                           "(it needs per-row prefix lengths)")
    tree_mask = attention_mask[:, 0] if attention_mask.shape[-1] else None
    out = ops.tree_attention(query, key, value, spec_prefix_lens, tree_mask, scale=scaling, validate=False)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, _attention)


def check_model(model, role: str) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"{role}: unsupported architecture {model_type!r}; spec_ext supports the decoder-only "
                         f"transformers models {SUPPORTED}")


def check_window(model, role: str, last_position: int) -> None:
    """Sliding-window attention is exact here while every query whose logits are used, at
    positions up to ``last_position``, still sees its whole prefix (position < window)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if window is None or not getattr(config, "use_sliding_window", True):
        return
    if last_position >= window:
        raise ValueError(f"{role}: the logits at position {last_position} are needed, past its sliding window "
                         f"({window}): spec_ext attends over the whole prefix, so a prompt plus max_new_tokens "
                         f"may hold at most {window + 1} tokens here; use shorter ones or a model without a "
                         "sliding window")


def check_pair(target, draft) -> None:
    check_model(target, "target")
    check_model(draft, "draft")
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise ValueError(f"draft: vocabulary size {vd} differs from the target's {vt}; speculative decoding "
                         "needs the same tokenizer for both models")
    if target.device != draft.device:
        raise ValueError(f"draft: on {draft.device} but the target is on {target.device}")


@contextlib.contextmanager
def attention_implementation(*models, fast_linear: bool | str | Sequence[bool | str] = False):
    """Route the models' attention through spec_ext for the duration of the block (and
    choose, per model, between the lean forward and the HF modules; ``fast_linear``, one
    for all models or one per model: see :func:`spec_ext.models.lean.prepare`)."""
    saved = [m.config._attn_implementation for m in models]
    fast = list(fast_linear) if isinstance(fast_linear, (list, tuple)) else [fast_linear] * len(models)
    if len(fast) != len(models):
        raise ValueError(f"fast_linear: {len(fast)} settings for {len(models)} models")
    try:
        for m, f in zip(models, fast):
            m.config._attn_implementation = ATTENTION
            lean.prepare(m, f)
        yield
    finally:
        for m, name in zip(models, saved):
            m.config._attn_implementation = name


@functools.lru_cache(None)
def _cache_argument(model_class) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


_NO_TREE = {}


def forward(model, input_ids: Tensor, cache, positions: Tensor, tree_mask: Tensor | None = None,
            hidden: bool = False, use_lean: bool = True):
    """One forward of T new tokens per row over ``cache`` (prefix lengths ``cache.lengths``).

    input_ids [B,T], positions [B,T], tree_mask [B|1,T,W] int32 or None (causal).
    Returns logits [B,T,V] (float32) and, when ``hidden``, the last hidden state [B,T,H].
    Llama-family models take the lean forward of :mod:`spec_ext.models.lean` (same numbers, less
    overhead) unless ``use_lean`` is False; others go through the HF modules.
    """
    cache.before_forward(input_ids, positions, tree_mask)
    decoder = lean.lean_decoder(model) if use_lean else None
    if decoder is not None:
        return decoder(input_ids, cache, positions, tree_mask, hidden)
    if tree_mask is None:
        key = (input_ids.device, input_ids.shape[1])
        if key not in _NO_TREE:
            _NO_TREE[key] = torch.zeros(1, 1, input_ids.shape[1], 0, dtype=torch.int32, device=input_ids.device)
        mask4d = _NO_TREE[key]
    else:
        mask4d = tree_mask.unsqueeze(1)
    out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask4d, use_cache=True,
                output_hidden_states=hidden, spec_prefix_lens=cache.lengths,
                **{_cache_argument(type(model)): cache})
    logits = out.logits.float()
    return (logits, out.hidden_states[-1]) if hidden else logits
