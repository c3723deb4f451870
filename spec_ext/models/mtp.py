"""A checkpoint's own multi-token-prediction (MTP) layers, through transformers' ``MtpModel``.

DeepSeek-V3, the GLM-4.5 family, ERNIE-4.5-MoE and others ship ``num_mtp_layers`` next-n
layers beside the main model. transformers 5.24 loads them (``MtpModel.from_pretrained``:
its weight regex and renamings, so every architecture it supports loads here) and runs them
as its own code does: layer i at sequence index p reads ``enorm(embed(x_{p+i+1}))`` and
``hnorm(h)``, where h is the main model's last hidden state at p (HF's
``hidden_states[-1]``, after its final norm) for layer 0 and layer i-1's output at p for
the others, projects them with ``eh_proj``, runs its decoder block (at position p + i + 1,
attending to its own cache of earlier indices) and its post-norm; the shared head (the
target's ``lm_head``) turns the output into the logits of x_{p+i+2}.

:func:`load_mtp` loads them for a target; :func:`layer_step` runs one layer over a
:class:`~spec_ext.models.cache.SpecCache` (one cache layer per MTP layer) with spec_ext's
attention (per-row offsets, tree masks), :func:`mtp_logits` applies the shared head.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor

from spec_ext.models.hf import ATTENTION

__all__ = ["layer_step", "load_mtp", "mtp_layers", "mtp_logits"]


def mtp_layers(model) -> int:
    """How many MTP layers ``model``'s config declares (``num_mtp_layers``; 0: none)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_mtp_layers", None) or 0)


def load_mtp(target):
    """The MTP layers of ``target``'s checkpoint (the directory it was loaded from,
    ``config.name_or_path``) as transformers' ``MtpModel``, on the target's device and in its
    dtype, in eval mode; their embedding, head and rotary embedding are the target's own.
    ValueError naming the target when its config declares no MTP layers or its checkpoint
    holds none of their weights."""
    from transformers.modeling_layers import MtpModel

    name = f"{type(target).__name__} (model_type {getattr(target.config, 'model_type', None)!r})"
    count = mtp_layers(target)
    if count < 1:
        raise ValueError(f"draft: 'mtp' drafts with the target's own MTP layers, but the target {name} has none "
                         "(its config declares no num_mtp_layers)")
    path = getattr(target.config, "name_or_path", "") or ""
    if not os.path.isdir(path):
        raise ValueError(f"draft: 'mtp' reads the MTP weights from the target's checkpoint directory, but the "
                         f"target {name} was not loaded from one (config.name_or_path={path!r}); load it with "
                         "from_pretrained from a local directory")
    try:
        mtp = MtpModel.from_pretrained(target, device_map={"": target.device})
    except (RuntimeError, ValueError, OSError) as error:
        raise ValueError(f"draft: the target {name} declares {count} MTP layers but its checkpoint {path!r} has "
                         f"no usable MTP weights ({error})") from error
    return mtp.to(dtype=target.dtype).eval()


@contextlib.contextmanager
def spec_attention(mtp):
    """While inside, ``mtp``'s layers attend through spec_ext's attention function."""
    config = mtp.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


_NO_TREE = {}


def layer_step(mtp, layer: int, ids: Tensor, hidden: Tensor, positions: Tensor, cache,
               tree_mask: Tensor | None = None) -> Tensor:
    """MTP layer ``layer`` over T inputs per row, as ``MtpModel.forward_layer`` computes it:
    ``ids`` [B,T] the tokens x_{p+layer+1}, ``hidden`` [B,T,H] the previous hidden states
    (the main model's, or the layer before's output, at the same indices), ``positions``
    [B,T] (p + layer + 1), over ``cache`` (prefix lengths ``cache.lengths``; the layer
    writes its cache layer ``layer`` at ``lengths[b] + j``), causal or with ``tree_mask``
    [B|1,T,W] int32. Returns the layer's output [B,T,H] (post-normed: what the shared head
    reads and the next layer takes as its previous hidden state). Call inside
    :func:`spec_attention`."""
    embeds = mtp.embed_tokens(ids).to(hidden.dtype)
    rope = None
    if mtp.rotary_emb is not None:
        kwargs = {"layer_type": mtp.config.layer_types[layer]} if mtp.has_per_layer_rope else {}
        rope = mtp.rotary_emb(embeds, position_ids=positions, **kwargs)
    if tree_mask is None:
        key = (ids.device, ids.shape[1])
        if key not in _NO_TREE:
            _NO_TREE[key] = torch.zeros(1, 1, ids.shape[1], 0, dtype=torch.int32, device=ids.device)
        mask = _NO_TREE[key]
    else:
        mask = tree_mask.unsqueeze(1)
    out = mtp.layers[layer](embeds, hidden, position_embeddings=rope, position_ids=positions, cache=cache,
                            attention_mask=mask, spec_prefix_lens=cache.lengths)
    if mtp.use_shared_post_norm:
        out = mtp.shared_post_norm(out)
    return out


def mtp_logits(mtp, hidden: Tensor) -> Tensor:
    """The shared head's logits [..., V] float32 of MTP outputs ``hidden`` [..., H], as
    ``MtpModel`` makes them (muP scaling, the unpadded vocabulary)."""
    return mtp._project_to_logits(hidden).float()
