"""EAGLE-1 and EAGLE-3 draft heads: one or a few decoder layers that read the target's own
hidden states, in the ``speculators`` format vLLM serves (and the original EAGLE layouts).

EAGLE-3 (``kind="eagle3"``): the target's hidden states of three layers ``layer_ids`` (HF's
``hidden_states[k]``: the input of decoder layer k; vLLM's default (2, L//2, L-3)) are
concatenated (ascending) and projected by ``fc`` (3Ht -> H). The first layer's attention
reads ``[input_layernorm(embed(token)); hidden_norm(h)]`` (2H wide) with the residual from
h (``hidden_norm(h)`` with ``norm_before_residual``); further layers are plain decoder layers
of the layer config's family (Llama, Qwen3: q/k norms); ``norm`` then ``lm_head`` over the
draft vocabulary, whose id i is the target's ``i + d2t[i]``. The feature at position t is
paired with the token at t + 1; after the first step the head feeds back its own pre-norm
output (post-norm with ``norm_output``), without ``fc``.

EAGLE-1 (``kind="eagle"``): the target's last hidden state (after its final norm, HF's
``hidden_states[L]``) and the token's embedding, ``fc([embed; hidden])`` (2H -> H), every
step; the first layer has no input norm; no final norm; the target's ``lm_head``.

P-EAGLE (speculators ``"peagle"``): an EAGLE-3 head with a ``mask_token_id`` and a learned
feature ``mask_hidden`` [1,1,A*Ht] (``combine``d like the target's): one forward drafts k
tokens, the root's pair then k - 1 slots (mask token, mask_hidden) at the next positions,
causal as every head's; slot j's output gives draft j + 1 (vLLM's parallel drafting).

:func:`load_head` reads a directory in either layout; :meth:`EagleHead.save` writes the
``speculators`` layout (EAGLE-1: the original layout, which vLLM's ``method="eagle"`` reads).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_ext import ops

KINDS = ("eagle3", "eagle")
LAYER_TYPES = ("llama", "qwen3", "qwen2", "mistral")  # decoder layers the head can be made of


@dataclass
class HeadConfig:
    """What a head is made of; ``layer`` is the HF config dict of its decoder layers (the
    ``transformer_layer_config`` of the speculators format; its ``vocab_size`` is the target's)."""
    kind: str
    layer: dict
    draft_vocab_size: int
    # EAGLE-3: ascending; None takes the target's (2, L//2, L-3). Id L is HF's last hidden state,
    # after the final norm (vLLM's id L is before it: a head trained there reads another feature)
    layer_ids: tuple[int, ...] | None = None
    target_hidden_size: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    fc_bias: bool = False
    verifier: dict = field(default_factory=dict)
    # P-EAGLE (speculators "peagle"): an EAGLE-3 head that drafts its k tokens in one forward,
    # slots 2..k fed this token with the head's learned ``mask_hidden`` as their feature
    mask_token_id: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"speculators_model_type: expected one of {KINDS}, got {self.kind!r}")
        if self.mask_token_id is not None:
            vocab = self.layer.get("vocab_size")
            if self.kind != "eagle3":
                raise ValueError("mask_token_id: only an EAGLE-3 head (P-EAGLE) drafts a block in one forward")
            if not isinstance(vocab, int) or not 0 <= int(self.mask_token_id) < vocab:
                raise ValueError(f"mask_token_id: {self.mask_token_id!r} is not a token of the vocabulary of {vocab}")
            self.mask_token_id = int(self.mask_token_id)
        if self.layer.get("model_type") not in LAYER_TYPES:
            raise ValueError(f"transformer_layer_config.model_type: expected one of {LAYER_TYPES}, got "
                             f"{self.layer.get('model_type')!r}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc, fc_norm: at most one may be set")
        if self.layer_ids is not None:
            self.layer_ids = tuple(int(k) for k in self.layer_ids)
            if not self.layer_ids:
                raise ValueError("eagle_aux_hidden_state_layer_ids: empty (omit it for the target's defaults)")
            if list(self.layer_ids) != sorted(self.layer_ids):
                raise ValueError(f"eagle_aux_hidden_state_layer_ids: {list(self.layer_ids)} is not ascending (the "
                                 f"features are concatenated in layer order, as vLLM taps them)")

    @property
    def num_aux(self) -> int:
        """How many target layers an EAGLE-3 head reads."""
        return 3 if self.layer_ids is None else len(self.layer_ids)


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, config, width: int):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=bias and config.model_type != "qwen2")
        if config.model_type == "qwen3":
            self.q_norm = _Norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = _Norm(self.head_dim, config.rms_norm_eps)
        self.scaling = self.head_dim ** -0.5

    def project(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """q [B,Hq,T,D], k and v [B,Hkv,T,D] of ``x`` [B,T,width], rotated by ``rope``."""
        B, T, _ = x.shape
        shape = (B, T, -1, self.head_dim)
        q, k, v = (_linear(p, x).view(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = (_rotate(t.transpose(1, 2), cos, sin) for t in (q, k))
        return q, k, v.transpose(1, 2)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache, index: int, tree_mask: Tensor | None) -> Tensor:
        q, k, v = self.project(x, rope)
        keys, values = cache.update(k, v, index)
        out = ops.tree_attention(q, keys, values, cache.lengths, tree_mask, self.scaling, validate=False)
        return _linear(self.o_proj, out.transpose(1, 2).flatten(2))


def _linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """F.linear while training; when drafting, spec_ext's skinny GEMM where it applies (CPU
    float32, a few rows: several times MKL's speed there), as the draft model's layers run."""
    if torch.is_grad_enabled() and (layer.weight.requires_grad or x.requires_grad):  # the kernel has no backward
        return layer(x)
    return ops.skinny_linear(x, layer.weight, layer.bias, validate=False)


def to_target_vocabulary(draft: Tensor, d2t: Tensor | None, vocab_size: int) -> Tensor:
    """Logits [..., V'] over a draft vocabulary to [..., vocab_size]: draft id i at target id
    ``i + d2t[i]`` (``d2t`` None: ids as they are), -inf at every other id."""
    if d2t is None and draft.shape[-1] == vocab_size:
        return draft
    logits = draft.new_full((*draft.shape[:-1], vocab_size), float("-inf"))
    ids = torch.arange(draft.shape[-1], device=draft.device)
    logits[..., ids if d2t is None else ids + d2t] = draft
    return logits


def rope_table(config, capacity: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    """cos, sin [capacity, D] of positions 0..capacity-1 for a decoder layer ``config`` (its
    ``rope_parameters``; ``head_dim`` set from the heads when the config has none)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    rotary = LlamaRotaryEmbedding(config).to(device)
    cos, sin = rotary(torch.empty(0, dtype=dtype, device=device), torch.arange(capacity, device=device)[None])
    return cos[0], sin[0]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class _Mlp(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return _linear(self.down_proj, F.silu(_linear(self.gate_proj, x)) * _linear(self.up_proj, x))


class _Layer(nn.Module):
    """A decoder layer; the first of an EAGLE-3 head reads [embedding; hidden] (2H), the
    first of an EAGLE-1 head has no input norm."""

    def __init__(self, config, kind: str, first: bool):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.joint = first and kind == "eagle3"
        if not (first and kind == "eagle"):
            self.input_layernorm = _Norm(H, eps)
        if self.joint:
            self.hidden_norm = _Norm(H, eps)
        self.self_attn = _Attention(config, 2 * H if self.joint else H)
        self.post_attention_layernorm = _Norm(H, eps)
        self.mlp = _Mlp(config)

    def inputs(self, x: Tensor, embeds: Tensor | None, norm_before_residual: bool) -> tuple[Tensor, Tensor]:
        """What the attention reads, and the residual."""
        if self.joint:
            normed = self.hidden_norm(x)
            return torch.cat([self.input_layernorm(embeds), normed], -1), normed if norm_before_residual else x
        return (self.input_layernorm(x) if hasattr(self, "input_layernorm") else x), x

    def finish(self, residual: Tensor, attended: Tensor) -> Tensor:
        x = residual + attended
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x: Tensor, rope, cache, index: int, tree_mask, embeds: Tensor | None = None,
                norm_before_residual: bool = False) -> Tensor:
        inputs, residual = self.inputs(x, embeds, norm_before_residual)
        return self.finish(residual, self.self_attn(inputs, rope, cache, index, tree_mask))


class EagleHead(nn.Module):
    """An EAGLE-1 or EAGLE-3 head (see the module docstring). ``embed_tokens`` is the head's
    own embedding table when its checkpoint has one (else the target's is used).

    Example:
        >>> head = load_head("path/to/head")                                  # doctest: +SKIP
        >>> spec_ext.generate(target, head, ids, max_new_tokens=64)           # doctest: +SKIP
    """

    def __init__(self, config: HeadConfig, own_embeddings: bool = False):
        super().__init__()
        from transformers import AutoConfig
        self.config = config
        layer = self.layer_config = AutoConfig.for_model(**config.layer)
        H, eps = layer.hidden_size, layer.rms_norm_eps
        Ht = config.target_hidden_size or H
        if config.kind == "eagle3":
            width = config.num_aux * Ht
            if config.norm_before_fc:
                self.input_norm = _Norm(width, eps)
            if config.fc_norm:
                self.fc_norm = nn.ModuleList(_Norm(Ht, eps) for _ in range(config.num_aux))
            self.fc = nn.Linear(width, H, bias=config.fc_bias)
            self.norm = _Norm(H, eps)
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
            if config.mask_token_id is not None:
                self.mask_hidden = nn.Parameter(torch.zeros(1, 1, width))
        else:
            self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        self.layers = nn.ModuleList(_Layer(layer, config.kind, i == 0) for i in range(layer.num_hidden_layers))
        self.embed_tokens = nn.Embedding(layer.vocab_size, H) if own_embeddings else None
        self._rope_table: tuple[Tensor, Tensor] | None = None

    @property
    def hidden_size(self) -> int:
        return self.layer_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.layer_config.num_hidden_layers

    def rope(self, positions: Tensor, dtype: torch.dtype, capacity: int) -> tuple[Tensor, Tensor]:
        """cos, sin [B,1,T,D] of ``positions`` [B,T], from a table made once per capacity."""
        table = self._rope_table
        if table is None or table[0].shape[0] < capacity or table[0].dtype != dtype or \
                table[0].device != positions.device:
            table = self._rope_table = rope_table(self.layer_config, capacity, dtype, positions.device)
        return table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)

    def combine(self, features: Tensor) -> Tensor:
        """EAGLE-3: the target's features [..., A*Ht] (its layers' hidden states, concatenated)
        to the head's hidden width [..., H]; EAGLE-1: as they are (fc runs every step)."""
        if self.config.kind == "eagle":
            return features
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        elif self.config.fc_norm:
            features = torch.cat([norm(x) for norm, x in zip(self.fc_norm, features.chunk(len(self.fc_norm), -1))],
                                 -1)
        return _linear(self.fc, features)

    def forward(self, embeds: Tensor, hidden: Tensor, positions: Tensor, cache, tree_mask: Tensor | None = None,
                target_head=None, vocab_size: int | None = None, logits_at: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """One draft forward of T tokens per row over the head's ``cache``: ``embeds`` [B,T,H]
        the tokens' embeddings, ``hidden`` [B,T,H] what each is paired with (:meth:`combine`d
        target features, or the head's own output of the step before), ``positions`` [B,T].
        Returns logits [B,T,V] float32 (at the columns ``logits_at`` [B,n] int64 alone:
        [B,n,V]) over the target's vocabulary of ``vocab_size`` tokens (default: the layer
        config's; EAGLE-3: -inf off the draft vocabulary; EAGLE-1: ``target_head``, the
        target's lm_head) and the hidden state to feed back [B,T,H]."""
        rope = self.rope(positions, embeds.dtype, cache.capacity)
        x = _linear(self.fc, torch.cat([embeds, hidden], -1)) if self.config.kind == "eagle" else hidden
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, cache, index, tree_mask, embeds, self.config.norm_before_residual)
        at = (lambda t: t) if logits_at is None else \
            (lambda t: t.gather(1, logits_at[..., None].expand(-1, -1, t.shape[-1])))
        if self.config.kind == "eagle":
            return target_head(at(x)).float(), x
        normed = self.norm(x)
        draft = _linear(self.lm_head, at(normed)).float()
        logits = to_target_vocabulary(draft, self.d2t, vocab_size or self.layer_config.vocab_size)
        return logits, normed if self.config.norm_output else x

    # ------------------------------------------------------------------ format
    def save(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the speculators layout (EAGLE-3)
        or the original EAGLE layout (EAGLE-1, which vLLM's ``method="eagle"`` reads)."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        c = self.config
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if c.kind == "eagle3":
            target_vocab = self.layer_config.vocab_size
            if c.draft_vocab_size == target_vocab:
                state.pop("d2t")
            else:
                t2d = torch.zeros(target_vocab, dtype=torch.bool)
                t2d[torch.arange(c.draft_vocab_size) + self.d2t.cpu()] = True
                state["t2d"] = t2d
            parallel = c.mask_token_id is not None
            config = dict(
                speculators_model_type="peagle" if parallel else "eagle3",
                architectures=["PEagleSpeculator" if parallel else "Eagle3Speculator"],
                transformer_layer_config=c.layer, draft_vocab_size=c.draft_vocab_size,
                norm_before_residual=c.norm_before_residual, norm_before_fc=c.norm_before_fc, fc_norm=c.fc_norm,
                norm_output=c.norm_output, target_hidden_size=c.target_hidden_size,
                eagle_aux_hidden_state_layer_ids=None if c.layer_ids is None else list(c.layer_ids),
                speculators_version="0.3.0",
                speculators_config=dict(algorithm="eagle3", default_proposal_method="greedy",
                                        proposal_methods=[dict(proposal_type="greedy", speculative_tokens=3,
                                                               verifier_accept_k=1, accept_tolerance=0.0)],
                                        verifier=c.verifier or dict(name_or_path=None, architectures=[])),
                spec_ext=dict(fc_bias=c.fc_bias), **(dict(mask_token_id=c.mask_token_id) if parallel else {}))
        else:
            config = dict(c.layer, bias=c.fc_bias, spec_ext=dict(kind="eagle"))
        save_file(state, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(config, indent=2))


def _weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))


def _weights(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file
    files = _weight_files(path)
    if not files:
        raise ValueError(f"draft: {path} has no weights (*.safetensors or pytorch_model*.bin)")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(load_file(str(file)) if file.suffix == ".safetensors" else
                     torch.load(file, map_location="cpu", weights_only=True))
    return state


def _weight_names(path: Path) -> set[str]:
    from safetensors import safe_open
    names: set[str] = set()
    for file in _weight_files(path):
        if file.suffix != ".safetensors":
            return set(_weights(path))
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    return names


def is_head_directory(path: str | Path) -> bool:
    """Whether ``path`` holds a head (a speculators config, an EAGLE-3 ``draft_vocab_size``
    config, or EAGLE-1 weights: ``fc`` and no ``lm_head``) rather than a causal LM."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        return False
    data = json.loads(config.read_text())
    if "speculators_model_type" in data or "draft_vocab_size" in data or data.get("spec_ext", {}).get("kind"):
        return True
    names = {name.removeprefix("model.") for name in _weight_names(path)}
    return "fc.weight" in names and "lm_head.weight" not in names


def load_head(path: str | Path, dtype: torch.dtype | None = None) -> EagleHead:
    """A head from a directory: the speculators layout (``speculators_model_type`` "eagle3",
    "peagle" or "eagle"), the original EAGLE-3 layout (``midlayer.*``, ``draft_vocab_size`` in a
    plain Llama config) or EAGLE-1's (``fc`` + ``layers.0.*`` without input norm, lm_head
    or final norm). Raises ``ValueError`` naming a field it cannot honour."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"draft: {path} has no config.json")
    data = json.loads((path / "config.json").read_text())
    state = _weights(path)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    if "speculators_model_type" in data:
        kind = data["speculators_model_type"]
        mask_token_id = None
        if kind == "peagle":  # vLLM's parallel drafting reads the mask token as ptd_token_id
            kind, mask_token_id = "eagle3", data.get("mask_token_id", data.get("ptd_token_id"))
            if mask_token_id is None:
                raise ValueError("mask_token_id: a P-EAGLE head needs the token of its masked slots")
            if "mask_hidden" not in state:
                raise ValueError("mask_hidden: a P-EAGLE head needs the learned feature of its masked slots")
            state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
        if kind == "eagle":  # the speculators EAGLE-1 names
            state = {k.replace("fusion_fc.", "fc.").replace("transformer.", "layers.0."): v for k, v in state.items()}
            if data.get("layernorms"):
                raise ValueError("layernorms: HASS-style extra norms are not supported")
        layer = dict(data["transformer_layer_config"])
        config = HeadConfig(kind, layer, data.get("draft_vocab_size", layer.get("vocab_size")),
                            data.get("eagle_aux_hidden_state_layer_ids"), data.get("target_hidden_size"),
                            # a speculators config without the key: vLLM's default, True
                            bool(data.get("norm_before_residual", True)), bool(data.get("norm_before_fc", False)),
                            bool(data.get("fc_norm", False)), bool(data.get("norm_output", False)),
                            "fc.bias" in state, (data.get("speculators_config") or {}).get("verifier") or {},
                            mask_token_id)
    else:
        kind = "eagle3" if "draft_vocab_size" in data or "d2t" in state or "lm_head.weight" in state else "eagle"
        layer = {k: v for k, v in data.items() if k not in ("draft_vocab_size", "target_hidden_size", "bias",
                                                             "spec_ext", "architectures")}
        layer.setdefault("model_type", "llama")
        config = HeadConfig(kind, layer, data.get("draft_vocab_size", layer.get("vocab_size")),
                            data.get("eagle_aux_hidden_state_layer_ids"), data.get("target_hidden_size"),
                            fc_bias="fc.bias" in state)
    head = EagleHead(config, "embed_tokens.weight" in state)
    if "d2t" not in state and config.kind == "eagle3":
        if config.draft_vocab_size != layer.get("vocab_size"):
            raise ValueError(f"d2t: a draft vocabulary of {config.draft_vocab_size} tokens for a target of "
                             f"{layer.get('vocab_size')} needs its map d2t")
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    state.pop("t2d", None)
    state = {k: v for k, v in state.items() if not k.startswith(("verifier_", "lm_head.") if config.kind == "eagle"
                                                                   else ("verifier_",))}
    if config.mask_token_id is not None and state["mask_hidden"].shape != head.mask_hidden.shape:
        raise ValueError(f"mask_hidden: {state['mask_hidden'].shape[-1]} wide, the head's features are "
                         f"{head.mask_hidden.shape[-1]} (its layers' concatenated hidden states)")
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "embed_tokens.weight"]
    if missing or unexpected:
        raise ValueError(f"draft: {path}: weights missing {missing[:6]}, unexpected {unexpected[:6]}")
    return head.to(dtype) if dtype is not None else head

