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
:class:`LeanMtp` computes the same layer step for Llama-family blocks (Llama, Mistral, Qwen2,
Qwen3: the classes :mod:`spec_ext.models.lean` reproduces) without the modules' per-call
machinery (the same numbers, bit for bit); :func:`why_not_lean_mtp` says when it cannot.

The speculators ``mtp`` directory format (speculators 0.9.0's ``MTPDraftModel``: one MTP layer,
``transformer_layer_config`` a config of the target's architecture, weights
``mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}`` beside the
decoder layer's own, embedding and head the verifier's) is read by :func:`load_speculators_mtp`
into the same ``MtpModel`` (``token_layernorm`` is ``enorm``, ``hidden_layernorm`` ``hnorm``,
``input_proj`` ``eh_proj``, ``final_layernorm`` ``post_norm``) and written by
:func:`save_speculators_mtp`. Its layer runs at the position of the hidden state it reads (the
library's and vLLM's), not one further on as transformers' ``MtpModel`` does:
``position_shift`` 0 instead of 1 (the same attention under RoPE, by relative positions).
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import Tensor

from spec_ext.models.hf import _ATTENTION_LAYERS, check_model, routed_attention

__all__ = ["LeanMtp", "is_mtp_directory", "layer_step", "load_mtp", "load_speculators_mtp", "mtp_layers",
           "mtp_logits", "position_shift", "save_speculators_mtp", "why_not_lean_mtp", "why_not_mtp"]


def mtp_layers(model) -> int:
    """How many MTP layers ``model``'s config declares (``num_mtp_layers``; 0: none)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_mtp_layers", None) or 0)


def why_not_mtp(config) -> str | None:
    """Why spec_ext cannot draft with the MTP layers ``config`` (an MTP config:
    ``get_mtp_config()``, or ``MtpModel.config``) describes, or None: every MTP layer must be
    a full or sliding-window attention layer (the KV cache is rolled back to the committed
    tokens each round; a recurrent state, e.g. linear attention's, cannot be)."""
    for i, kind in enumerate(getattr(config, "layer_types", None) or []):
        if kind not in _ATTENTION_LAYERS:
            return (f"its MTP layer {i} is a {kind!r} layer: spec_ext rolls the MTP layers' state back to the "
                    "committed tokens every round, which it can do for full and sliding-window attention only")
    return None


def load_mtp(target):
    """The MTP layers of ``target``'s checkpoint (the directory it was loaded from,
    ``config.name_or_path``) as transformers' ``MtpModel``, on the target's device and in its
    dtype, in eval mode; their embedding, head and rotary embedding are the target's own.
    ValueError naming the target when its config declares no MTP layers, when spec_ext cannot
    decode it (``spec_ext.models.hf.unsupported_reason``: e.g. bailing_hybrid's linear
    attention, Inkling's short convolutions, both recurrent), when its MTP layers are not
    attention layers (:func:`why_not_mtp`), or when its checkpoint holds none of their weights."""
    from transformers.modeling_layers import MtpModel

    name = f"{type(target).__name__} (model_type {getattr(target.config, 'model_type', None)!r})"
    count = mtp_layers(target)
    if count < 1:
        raise ValueError(f"draft: 'mtp' drafts with the target's own MTP layers, but the target {name} has none "
                         "(its config declares no num_mtp_layers)")
    check_model(target, "target")  # before reading anything: a target spec_ext cannot decode, by name
    try:
        reason = why_not_mtp(target.config.get_mtp_config())
    except ValueError as error:  # transformers cannot say how to build them (e.g. layer types without MTP ones)
        reason = f"transformers cannot build its MTP layers ({error})"
    if reason is not None:
        raise ValueError(f"draft: 'mtp' cannot draft with the MTP layers of the target {name}: {reason}")
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


def spec_attention(mtp):
    """While inside, ``mtp``'s layers attend through spec_ext's attention function (on this
    thread: other threads' calls of the same layers are theirs)."""
    return routed_attention(mtp)


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


def why_not_lean_mtp(mtp) -> str | None:
    """Why :class:`LeanMtp` cannot reproduce ``mtp``'s layers (so they run on the HF modules),
    or None when it can: every MTP block a Llama-family decoder layer (the classes
    :mod:`spec_ext.models.lean` knows) with its norms, ``enorm``/``hnorm``/``post_norm`` and
    the shared post-norm of those norm classes, a plain embedding, a static RoPE the same for
    every layer, no forward hooks; not in train mode, not forced onto the HF modules
    (``spec_ext.models.hf_modules(mtp)``)."""
    from torch import nn
    from torch.nn.modules import module as nn_module
    from transformers.modeling_layers import MtpLayer

    from spec_ext.models import lean
    if mtp in lean._FORCED:
        return "forced onto the HF modules (spec_ext.models.hf_modules)"
    if mtp.training:
        return "in train mode (the HF modules apply dropout)"
    blocks, attentions, mlps, norms = lean._known_layer_classes()
    if type(mtp.embed_tokens) is not nn.Embedding:
        return f"the embedding is a {type(mtp.embed_tokens).__name__}"
    if mtp.rotary_emb is None or mtp.has_per_layer_rope:
        return "no rotary embedding, or one per layer type"
    rope = getattr(mtp.config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in lean._STATIC_ROPE:
        return f"rope_type {rope.get('rope_type')!r} changes with the sequence length"
    hooked = [name or "the MTP model" for name, m in mtp.named_modules() if lean._hooked(m)]
    if hooked:
        return f"forward hooks or a patched forward on {hooked[0]}"
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "global module forward hooks"
    if mtp.use_shared_post_norm and type(mtp.shared_post_norm) not in norms:
        return "unknown shared post-norm"
    for layer in mtp.layers:
        block = layer.mtp_block
        if type(layer) is not MtpLayer or type(layer.eh_proj) is not nn.Linear or layer.eh_proj.bias is not None:
            return f"unknown MTP layer {type(layer).__name__}"
        if (type(block) not in blocks or type(block.self_attn) not in attentions or type(block.mlp) not in mlps
                or type(block.input_layernorm) not in norms or type(block.post_attention_layernorm) not in norms):
            return f"unknown MTP block modules in {type(block).__name__}"
        head_norms = [getattr(block.self_attn, n, None) for n in ("q_norm", "k_norm")]
        if any(n is not None and type(n) not in norms for n in head_norms):
            return f"unknown q/k norms in {type(block.self_attn).__name__}"
        own = [layer.enorm, layer.hnorm] + ([layer.post_norm] if layer.use_post_norm else [])
        if any(type(n) not in norms for n in own):
            return "unknown enorm, hnorm or post_norm"
    return None


class LeanMtp:
    """:func:`layer_step` for MTP layers whose blocks :mod:`spec_ext.models.lean` knows
    (:func:`why_not_lean_mtp` is None), op for op what ``MtpLayer.forward`` and the
    decoder layer compute (bit-equal outputs and cache entries), reading the parameters in
    place, the rotary cos/sin from a table of what ``mtp.rotary_emb`` returns."""

    def __init__(self, mtp):
        from spec_ext.models import lean
        self.embed, self.padding_idx = mtp.embed_tokens.weight, mtp.embed_tokens.padding_idx
        self.rotary_emb, self.hidden_first = mtp.rotary_emb, bool(getattr(mtp.config, "mtp_hidden_states_first", False))
        self.shared_post_norm = lean._norm(mtp.shared_post_norm) if mtp.use_shared_post_norm else None
        self.layers = []
        for layer in mtp.layers:
            block = layer.mtp_block
            attn, mlp = block.self_attn, block.mlp
            self.layers.append(dict(
                enorm=lean._norm(layer.enorm), hnorm=lean._norm(layer.hnorm), eh_proj=layer.eh_proj.weight,
                post=lean._norm(layer.post_norm) if layer.use_post_norm else None,
                input_norm=lean._norm(block.input_layernorm), post_norm=lean._norm(block.post_attention_layernorm),
                q=lean._linear(attn.q_proj), k=lean._linear(attn.k_proj), v=lean._linear(attn.v_proj),
                o=lean._linear(attn.o_proj), gate=lean._linear(mlp.gate_proj), up=lean._linear(mlp.up_proj),
                down=lean._linear(mlp.down_proj), act=mlp.act_fn, head_dim=attn.head_dim, scaling=attn.scaling,
                window=lean._window(attn), q_norm=lean._head_norm(attn, "q_norm"), k_norm=lean._head_norm(attn, "k_norm")))
        self._rope: tuple[Tensor, Tensor] | None = None

    # positions start below 0: a one-token prompt's first round runs layer i at index -1 (its zero hidden state)
    _BELOW = 8

    def _rotary(self, positions: Tensor, dtype: torch.dtype, size: int) -> tuple[Tensor, Tensor]:
        """cos, signed sin [B,1,T,D] for ``positions`` [B,T] (from -8 to below ``size``), from
        a table made once per size (the sin's first half negated:
        :func:`spec_ext.models.lean._rotate`)."""
        table, below = self._rope, self._BELOW
        if table is None or table[0].shape[0] < size + below or table[0].dtype != dtype or \
                table[0].device != positions.device:
            probe = torch.empty(0, dtype=dtype, device=positions.device)
            cos, sin = self.rotary_emb(probe, torch.arange(-below, size, device=positions.device)[None])
            half = sin.shape[-1] // 2
            table = self._rope = (cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1))
        index = positions + below
        return table[0][index].unsqueeze(1), table[1][index].unsqueeze(1)

    def step(self, layer: int, ids: Tensor, hidden: Tensor, positions: Tensor, cache,
             tree_mask: Tensor | None = None) -> Tensor:
        """What :func:`layer_step` returns for the same arguments (``tree_mask`` [B|1,T,W]
        int32 or None: causal), writing the same cache entries."""
        import torch.nn.functional as F

        from spec_ext import ops
        from spec_ext.models.lean import _rms_norm, _rotate
        p = self.layers[layer]
        B, T = ids.shape
        embeds = F.embedding(ids, self.embed, self.padding_idx).to(hidden.dtype)
        parts = [_rms_norm(embeds, *p["enorm"]), _rms_norm(hidden, *p["hnorm"])]
        x = F.linear(torch.cat(parts[::-1] if self.hidden_first else parts, -1), p["eh_proj"])
        # the capacity may grow (SpecCache.reserve); positions run up to a few past it (index + layer + shift)
        cos, signed_sin = self._rotary(positions, x.dtype, cache.capacity + len(self.layers) + 2)
        h = _rms_norm(x, *p["input_norm"])
        shape = (B, T, -1, p["head_dim"])
        q, k = F.linear(h, *p["q"]).view(shape), F.linear(h, *p["k"]).view(shape)
        if p["q_norm"] is not None:
            q, k = _rms_norm(q, *p["q_norm"]), _rms_norm(k, *p["k_norm"])
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = F.linear(h, *p["v"]).view(shape).transpose(1, 2)
        q, k = _rotate(q, cos, signed_sin), _rotate(k, cos, signed_sin)
        keys, values = cache.update(k, v, layer)
        a = ops.tree_attention(q, keys, values, cache.lengths, tree_mask, scale=p["scaling"], window=p["window"],
                               validate=False)
        x = x + F.linear(a.transpose(1, 2).reshape(B, T, -1), *p["o"])
        h = _rms_norm(x, *p["post_norm"])
        x = x + F.linear(p["act"](F.linear(h, *p["gate"])) * F.linear(h, *p["up"]), *p["down"])
        if p["post"] is not None:
            x = _rms_norm(x, *p["post"])
        if self.shared_post_norm is not None:
            x = _rms_norm(x, *self.shared_post_norm)
        return x


def mtp_logits(mtp, hidden: Tensor) -> Tensor:
    """The shared head's logits [..., V] float32 of MTP outputs ``hidden`` [..., H], as
    ``MtpModel`` makes them (muP scaling, the unpadded vocabulary)."""
    return mtp._project_to_logits(hidden).float()


def position_shift(mtp) -> int:
    """Where ``mtp``'s layer i at sequence index p runs: position p + i + shift (1: transformers'
    ``MtpModel`` from a checkpoint; 0: a speculators ``mtp`` directory, as the library trains it
    and vLLM runs it)."""
    return int(getattr(mtp, "spec_ext_position_shift", 1))


# ---------------------------------------------------------------- the speculators mtp format
_SPECULATORS_KEYS = {"speculators_model_type", "architectures", "auto_map", "dtype", "torch_dtype",
                     "num_nextn_predict_layers", "speculators_config", "speculators_version", "tie_word_embeddings",
                     "transformer_layer_config", "transformers_version"}
# the layer's own modules, speculators' names -> MtpLayer's
_RENAMES = {"token_layernorm.": "enorm.", "hidden_layernorm.": "hnorm.", "input_proj.": "eh_proj.",
            "final_layernorm.": "post_norm."}
# weights the library may save that the target provides (the verifier's; vLLM and the library load them from it)
_VERIFIER_WEIGHTS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")
# the library picks the last full-attention layer's config for these hybrid architectures
_HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def is_mtp_directory(path: str | Path) -> bool:
    """Whether ``path`` holds a speculators ``mtp`` checkpoint (``speculators_model_type: "mtp"``)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("speculators_model_type") == "mtp"
    except (ValueError, AttributeError):
        return False


class _Verifier:
    """What ``MtpModel.__init__`` reads of its main model: the MTP config, the decoder (its
    layer and norm classes, rotary embedding), the embedding and the head (the target's)."""

    def __init__(self, target, config):
        self.config, self._target, self.lm_head = config, target, target.lm_head

    def get_decoder(self):
        return self._target.get_decoder()

    def get_input_embeddings(self):
        return self._target.get_input_embeddings()


def _layer_config(layer: dict, target):
    """The checkpoint's ``transformer_layer_config`` as a config of the target's class, made
    an MTP config of one layer (its layer types the one the library builds its layer with)."""
    config = type(target.config.get_text_config())(**{k: v for k, v in layer.items()
                                                     if k not in ("architectures", "transformers_version")})
    config.num_mtp_layers = 1
    types = getattr(config, "layer_types", None)
    if types is not None:
        index = 0
        if layer.get("model_type") in _HYBRID:
            full = [i for i, t in enumerate(types) if t == "full_attention"]
            if not full:
                raise ValueError("transformer_layer_config.layer_types: a hybrid MTP layer needs a full_attention "
                                 "layer's config, there is none")
            index = full[-1]
        config.mtp_layer_types = [types[index]]
    return config


def load_speculators_mtp(path: str | Path, target):
    """The MTP layer of a speculators ``mtp`` directory as transformers' ``MtpModel`` for
    ``target`` (its embedding, head, decoder-layer and norm classes), on the target's device
    and in its dtype, in eval mode (``position_shift`` 0). The layer reads the target's last
    hidden state (HF's ``hidden_states[L]``). Raises ``ValueError`` naming the field for a
    checkpoint made for another target (model type, hidden size, vocabulary, layer count) or
    one spec_ext cannot honour (more than one layer, unknown fields or weights)."""
    from safetensors.torch import load_file
    from transformers import initialization
    from transformers.modeling_layers import MtpModel

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"draft: {path} has no config.json")
    data = json.loads((path / "config.json").read_text())
    if data.get("speculators_model_type") != "mtp":
        raise ValueError(f"speculators_model_type: {data.get('speculators_model_type')!r} is not 'mtp'")
    unknown = sorted(set(data) - _SPECULATORS_KEYS)
    if unknown:
        raise ValueError(f"{unknown[0]}: a speculators mtp field spec_ext does not know (it cannot honour it)")
    if int(data.get("num_nextn_predict_layers", 1)) != 1:
        raise ValueError(f"num_nextn_predict_layers: {data['num_nextn_predict_layers']} (the speculators mtp format "
                         f"holds one MTP layer, re-applied past the first draft)")
    algorithm = (data.get("speculators_config") or {}).get("algorithm", "mtp")
    if algorithm != "mtp":
        raise ValueError(f"speculators_config.algorithm: {algorithm!r} is not 'mtp'")
    layer = data.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("transformer_layer_config: missing (the MTP layer's architecture)")
    text = target.config.get_text_config()
    if layer.get("model_type") != text.model_type:
        raise ValueError(f"transformer_layer_config.model_type: {layer.get('model_type')!r}, but the target is "
                         f"{text.model_type!r} (the MTP layer is a decoder layer of the target's architecture)")
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if field in layer and layer[field] != getattr(text, field):
            raise ValueError(f"transformer_layer_config.{field}: {layer[field]}, but the target's is "
                             f"{getattr(text, field)} (a checkpoint made for another target)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"draft: {path} has no weights (*.safetensors)")
    state = {}
    for file in files:
        state.update(load_file(str(file)))
    renamed, unexpected = {}, []
    for name, tensor in state.items():
        if name in _VERIFIER_WEIGHTS:
            continue
        if not name.startswith("mtp_layers.0."):
            unexpected.append(name)
            continue
        rest = name[len("mtp_layers.0."):]
        for old, new in _RENAMES.items():
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        else:
            rest = "mtp_block." + rest
        renamed["layers.0." + rest] = tensor
    if unexpected:
        raise ValueError(f"draft: {path}: weights spec_ext does not know (it cannot honour them): {sorted(unexpected)[:6]}")
    config = _layer_config(layer, target)
    with initialization.no_init_weights(), initialization.no_tie_weights():
        mtp = MtpModel(_Verifier(target, config), 1)
    rotary = getattr(target.get_decoder(), "rotary_emb", None)
    if rotary is not None:  # the layer's own rope (the library builds it from transformer_layer_config)
        mtp.rotary_emb = type(rotary)(config=mtp.config)
    missing, extra = mtp.layers.load_state_dict({k[len("layers."):]: v for k, v in renamed.items()}, strict=False)
    if missing or extra:
        raise ValueError(f"draft: {path}: MTP layer weights missing {sorted(missing)[:6]}, unexpected "
                         f"{sorted(extra)[:6]} (transformer_layer_config does not describe them)")
    mtp.spec_ext_position_shift = 0
    mtp.spec_ext_speculators = {k: copy.deepcopy(data[k]) for k in ("transformer_layer_config", "speculators_config")
                                if k in data}
    return mtp.to(device=target.device, dtype=target.dtype).eval()


def save_speculators_mtp(mtp, path: str | Path, target, speculative_tokens: int = 3) -> None:
    """Write ``mtp`` (an ``MtpModel`` of one layer) as a speculators ``mtp`` directory for
    ``target``: ``config.json`` and ``model.safetensors`` (``mtp_layers.0.*``; the embedding
    and head are the target's and not written). A model loaded by :func:`load_speculators_mtp`
    keeps its ``transformer_layer_config`` and ``speculators_config``; others take the
    target's config and ``speculative_tokens`` greedy drafts. ValueError naming what the format
    cannot hold (more layers, a shared post-norm, the hidden state before the embedding)."""
    from safetensors.torch import save_file

    if len(mtp.layers) != 1:
        raise ValueError(f"num_nextn_predict_layers: the speculators mtp format holds one MTP layer, this model has "
                         f"{len(mtp.layers)}")
    if getattr(mtp, "use_shared_post_norm", False) or not getattr(mtp, "use_post_norm", True):
        raise ValueError("post_norm: the speculators mtp format has one final norm per layer, this model has none "
                         "(a shared post-norm)")
    if getattr(mtp.config, "mtp_hidden_states_first", False):
        raise ValueError("mtp_hidden_states_first: the speculators mtp format projects [embedding; hidden]")
    if getattr(mtp.config, "logits_mup_width_multiplier", None) is not None:
        raise ValueError("logits_mup_width_multiplier: the speculators mtp format applies the head unscaled")
    back = {new: old for old, new in _RENAMES.items()}
    state = {}
    for name, tensor in mtp.layers[0].state_dict().items():
        for new, old in back.items():
            if name.startswith(new):
                name = old + name[len(new):]
                break
        else:
            name = name.removeprefix("mtp_block.")
        state["mtp_layers.0." + name] = tensor.detach().contiguous().cpu()
    kept = getattr(mtp, "spec_ext_speculators", None) or {}
    layer = kept.get("transformer_layer_config") or target.config.get_text_config().to_diff_dict()
    verifier = dict(name_or_path=getattr(target.config, "name_or_path", None) or None,
                    architectures=list(getattr(target.config, "architectures", None) or []))
    speculators = kept.get("speculators_config") or dict(
        algorithm="mtp", default_proposal_method="greedy",
        proposal_methods=[dict(proposal_type="greedy", speculative_tokens=int(speculative_tokens),
                               verifier_accept_k=1, accept_tolerance=0.0)], verifier=verifier)
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config = dict(architectures=["MTPDraftModel"], auto_map={"": "config.MTPSpeculatorConfig"}, dtype=dtype,
                  num_nextn_predict_layers=1, speculators_config=speculators, speculators_model_type="mtp",
                  speculators_version="0.9.0", tie_word_embeddings=bool(layer.get("tie_word_embeddings", False)),
                  transformer_layer_config=layer)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
