"""DFlash block drafters: one forward drafts a whole block from the target's hidden states.

The drafter (arXiv 2602.06036; the speculators ``dflash`` format vLLM serves, and z-lab's own
checkpoints) is a few Qwen3 decoder layers whose keys and values are the *context* followed by
the *block*:

* context: the target's features (HF's ``hidden_states[k]`` of the layers ``layer_ids``,
  concatenated) of every committed position t < n before the anchor, projected once by
  ``hidden_norm(fc(.))`` [.., H] and then by each layer's ``k_proj`` (with ``k_norm``) and
  ``v_proj``, rotated at position t. The decoding drafter caches these per layer in a
  :class:`spec_ext.models.SpecCache` (one entry per committed position, extended each round
  with the accepted positions' features);
* block: b queries ``[anchor, mask x (b-1)]`` at positions n .. n+b-1, the anchor being the
  last committed token x_n, embedded by the target's embedding table (raw rows, no scale);
  they attend to the context and bidirectionally to the whole block.

After the layers, ``norm`` and the output head (the target's, or the drafter's own reduced
``lm_head`` over ``draft_vocab_size`` ids, id i being the target's ``i + d2t[i]``) give slot
j's logits; slot j (1 <= j < b) predicts the token at n + j, so a block proposes b - 1
drafts (``sample_from_anchor``: slot j predicts n + j + 1 and the block proposes b).

Sliding layers (``layer_types``, with the layer config's ``sliding_window``: a Qwen3 config
has one only with ``use_sliding_window``): a block query sees the context positions t with
``n - t <= sliding_window`` and, unless ``sliding_window_non_causal``, only the block slots
at or before its own (the speculators library's masks); full layers always see the whole
context and block.

:func:`load_dflash` reads the speculators layout and z-lab's; :meth:`DFlashDraft.save`
writes the speculators layout. :meth:`DFlashDraft.block_logits` is the whole-sequence
forward (many anchors, no cache) that training runs through and that the cached forward is
checked against.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_ext.models.eagle import _linear, _Mlp, _Norm, _rotate, _weights, rope_table, to_target_vocabulary

# the keys of a speculators config this module reads or knows to be harmless
_SPECULATORS_KEYS = {"speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
                     "block_size", "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id",
                     "sliding_window_non_causal", "sample_from_anchor", "projector_type", "shift_label",
                     "speculators_version", "speculators_config", "pure_draft_prefix_len", "emb_dim",
                     "gru_hidden_dim", "lambda_base_start", "lambda_base_decay_ratio", "auf", "spec_ext",
                     "torch_dtype", "dtype", "transformers_version", "auto_map", "tie_word_embeddings"}
# z-lab dflash_config entries that change the forward, and what spec_ext needs them to be
_ZLAB_NEUTRAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
_ZLAB_DFLASH2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlashConfig:
    """What a DFlash drafter is made of.

    ``layer``: the HF config dict of its decoder layers (speculators' ``transformer_layer_config``;
    its ``vocab_size`` is the target's, its ``hidden_size`` the drafter's H). ``layer_ids``: the
    target hidden states read (HF's ``hidden_states[k]``, k in 0..L). ``mask_token_id``: the
    token of the b - 1 masked slots (a target id). ``draft_vocab_size`` below the vocabulary:
    the drafter's own ``lm_head`` over those ids, mapped by ``d2t``. ``num_target_layers``:
    the target's L where the checkpoint names it (z-lab), checked when bound.
    """
    layer: dict
    block_size: int
    layer_ids: tuple[int, ...]
    mask_token_id: int
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    sample_from_anchor: bool = False
    sliding_window_non_causal: bool = False
    num_target_layers: int | None = None
    verifier: dict = field(default_factory=lambda: dict(name_or_path=None, architectures=[]))

    def __post_init__(self):
        vocab = self.layer.get("vocab_size")
        if not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"transformer_layer_config.vocab_size: expected a positive int, got {vocab!r}")
        if self.draft_vocab_size is None:
            self.draft_vocab_size = vocab
        if not 1 <= self.draft_vocab_size <= vocab:
            raise ValueError(f"draft_vocab_size: {self.draft_vocab_size} is not in 1..{vocab} (the vocabulary)")
        if not isinstance(self.block_size, int) or self.block_size < 2 - int(self.sample_from_anchor):
            raise ValueError(f"block_size: {self.block_size!r} proposes no draft (at least "
                             f"{2 - int(self.sample_from_anchor)} slots)")
        if self.mask_token_id is None or not 0 <= int(self.mask_token_id) < vocab:
            raise ValueError(f"mask_token_id: {self.mask_token_id!r} is not a token of the vocabulary of {vocab}")
        self.mask_token_id = int(self.mask_token_id)
        if not self.layer_ids:
            raise ValueError("aux_hidden_state_layer_ids: empty (the drafter reads at least one target layer)")
        self.layer_ids = tuple(int(k) for k in self.layer_ids)
        if any(k < 0 for k in self.layer_ids):
            raise ValueError(f"aux_hidden_state_layer_ids: {list(self.layer_ids)} has negative ids")
        if self.layer.get("num_hidden_layers", 0) < 1:
            raise ValueError(f"transformer_layer_config.num_hidden_layers: {self.layer.get('num_hidden_layers')!r}")
        types = self.layer.get("layer_types")
        if types is not None:
            if len(types) < self.layer["num_hidden_layers"] or \
                    set(types) - {"full_attention", "sliding_attention"}:
                raise ValueError(f"transformer_layer_config.layer_types: {types} (one of full_attention, "
                                 f"sliding_attention per layer)")

    @property
    def num_drafts(self) -> int:
        """Drafts one block proposes: b - 1 (b with ``sample_from_anchor``)."""
        return self.block_size - (0 if self.sample_from_anchor else 1)

    @property
    def first_slot(self) -> int:
        """The block slot whose output is the first draft's logits."""
        return 0 if self.sample_from_anchor else 1


class _Attention(nn.Module):
    """Qwen3 attention (q/k norms) whose keys/values are the context's then the block's."""

    def __init__(self, config):
        super().__init__()
        heads, kv_heads, H = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or H // heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(H, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, H, bias=bias)
        self.q_norm = _Norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = _Norm(self.head_dim, config.rms_norm_eps)
        self.scaling = self.head_dim ** -0.5

    def keys_values(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """k, v [B,Hkv,T,D] of ``x`` [B,T,H] (k rotated by ``rope``, cos/sin [B,1,T,D])."""
        shape = (*x.shape[:2], -1, self.head_dim)
        k = self.k_norm(_linear(self.k_proj, x).view(shape)).transpose(1, 2)
        return _rotate(k, *rope), _linear(self.v_proj, x).view(shape).transpose(1, 2)

    def queries(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        """q [B,Hq,T,D] of ``x`` [B,T,H], rotated."""
        q = self.q_norm(_linear(self.q_proj, x).view(*x.shape[:2], -1, self.head_dim)).transpose(1, 2)
        return _rotate(q, *rope)

    def output(self, attended: Tensor) -> Tensor:
        """o_proj of the attention's output [B,Hq,T,D] -> [B,T,H]."""
        return _linear(self.o_proj, attended.transpose(1, 2).flatten(2))


class _Layer(nn.Module):
    def __init__(self, config, sliding: bool):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = sliding
        self.input_layernorm = _Norm(H, eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = _Norm(H, eps)
        self.mlp = _Mlp(config)

    def finish(self, residual: Tensor, attended: Tensor) -> Tensor:
        x = residual + self.self_attn.output(attended)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """A DFlash block drafter (see the module docstring). ``embed_tokens`` is its own embedding
    table when its checkpoint has one (else the target's is used); ``lm_head`` exists only for
    a reduced draft vocabulary (else the target's output head is used).

    Example:
        >>> draft = load_dflash("path/to/dflash")                      # doctest: +SKIP
        >>> spec_ext.generate(target, draft, ids, max_new_tokens=64)   # doctest: +SKIP
    """

    def __init__(self, config: DFlashConfig, own_embeddings: bool = False):
        super().__init__()
        from transformers import AutoConfig
        self.config = config
        layer = self.layer_config = AutoConfig.for_model(**config.layer)
        H, eps = layer.hidden_size, layer.rms_norm_eps
        Ht = config.target_hidden_size or H
        # as the speculators library reads them: a sliding layer without a window (a Qwen3 config
        # with use_sliding_window false has none) attends as a full one
        self.window = getattr(layer, "sliding_window", None)
        types = getattr(layer, "layer_types", None) or ["full_attention"] * layer.num_hidden_layers
        self.fc = nn.Linear(len(config.layer_ids) * Ht, H, bias=False)
        self.hidden_norm = _Norm(H, eps)
        self.layers = nn.ModuleList(_Layer(layer, types[i] == "sliding_attention" and self.window is not None)
                                    for i in range(layer.num_hidden_layers))
        self.norm = _Norm(H, eps)
        self.reduced = config.draft_vocab_size < layer.vocab_size
        if self.reduced:
            self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        else:
            self.lm_head, self.d2t = None, None
        self.embed_tokens = nn.Embedding(layer.vocab_size, H) if own_embeddings else None
        self._rope_table: tuple[Tensor, Tensor] | None = None

    @property
    def hidden_size(self) -> int:
        return self.layer_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.layer_config.num_hidden_layers

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def feature_width(self) -> int:
        """The width of the target features it reads: len(layer_ids) * the target's hidden size."""
        return self.fc.in_features

    def rope(self, positions: Tensor, dtype: torch.dtype, capacity: int) -> tuple[Tensor, Tensor]:
        """cos, sin [B,1,T,D] of ``positions`` [B,T] (each below ``capacity``)."""
        table = self._rope_table
        if table is None or table[0].shape[0] < capacity or table[0].dtype != dtype or \
                table[0].device != positions.device:
            table = self._rope_table = rope_table(self.layer_config, capacity, dtype, positions.device)
        return table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)

    # ------------------------------------------------------------ pieces both forwards share
    def project(self, features: Tensor) -> Tensor:
        """The target's features [..., A*Ht] (layer order as ``layer_ids``) to the context
        states [..., H]: ``hidden_norm(fc(features))``."""
        return self.hidden_norm(_linear(self.fc, features))

    def block_tokens(self, anchors: Tensor) -> Tensor:
        """[..., b] int64: each anchor token [...] followed by b - 1 mask tokens."""
        block = anchors.new_full((*anchors.shape, self.block_size), self.config.mask_token_id)
        block[..., 0] = anchors
        return block

    def embed(self, tokens: Tensor, embedding: Tensor | None) -> Tensor:
        """Rows of the drafter's own table, else of ``embedding`` [V,H] (the target's weight)."""
        if self.embed_tokens is not None:
            return self.embed_tokens(tokens.clamp_max(self.embed_tokens.num_embeddings - 1))
        return F.embedding(tokens, embedding)

    def draft_logits(self, hidden: Tensor, output: Tensor | None) -> Tensor:
        """Logits [..., V'] float32 of the drafter's outputs [..., H] over its own vocabulary:
        its ``lm_head`` (V' = draft_vocab_size) or ``output`` [V,H] (the target's head)."""
        normed = self.norm(hidden)
        if self.lm_head is not None:
            return _linear(self.lm_head, normed).float()
        return F.linear(normed, output).float()

    def logits(self, hidden: Tensor, output: Tensor | None, vocab_size: int | None = None) -> Tensor:
        """:meth:`draft_logits` over the target's vocabulary of ``vocab_size`` (default the layer
        config's): a reduced vocabulary's ids placed by d2t, -inf elsewhere; the target's head's
        logits padded with -inf to ``vocab_size``."""
        return to_target_vocabulary(self.draft_logits(hidden, output), self.d2t,
                                    vocab_size or self.layer_config.vocab_size)

    # ------------------------------------------------------------ the decoding forward
    def extend(self, context: Tensor, cache, counts: list[int], device_counts: Tensor | None = None) -> None:
        """Append ``context`` [B,C,H] (:meth:`project`ed features; row b's first ``counts[b]``
        are real) to ``cache`` at each row's next positions ``cache.lengths[b] + j`` (a row's
        cache length is the number of its committed positions it holds, and the position of
        the next entry), and advance the cache by ``counts``."""
        if context.shape[1] == 0:
            return
        positions = cache.lengths[:, None] + torch.arange(context.shape[1], device=context.device)
        rope = self.rope(positions, context.dtype, cache.capacity)
        for index, layer in enumerate(self.layers):
            cache.update(*layer.self_attn.keys_values(context, rope), index)
        cache.advance(counts, device_counts)

    def forward(self, embeds: Tensor, cache, slots: int | None = None) -> Tensor:
        """One block per row over the cached context: ``embeds`` [B,b,H] the block's embeddings
        (:meth:`block_tokens`, :meth:`embed`), at positions ``cache.lengths[b] + j`` (the anchor
        right after the row's context). The block's keys are written past each row's context
        as scratch and the cache's lengths do not change. Returns the outputs [B,b,H] before
        ``norm`` (:meth:`logits` of slots ``first_slot ..`` are the drafts' logits); with
        ``slots``, those of block positions ``first_slot .. first_slot + slots - 1`` alone
        [B,slots,H]: every layer still keys the whole block, the last one queries only these."""
        B, b, _ = embeds.shape
        first = self.config.first_slot
        kept = slice(None) if slots is None else slice(first, min(b, first + slots))
        lengths = cache.lengths
        positions = lengths[:, None] + torch.arange(b, device=embeds.device)
        rope = self.rope(positions, embeds.dtype, cache.capacity)
        x = embeds
        visible: dict[bool, Tensor] = {}
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            normed = layer.input_layernorm(x)
            keys, values = cache.update(*layer.self_attn.keys_values(normed, rope), index)
            if layer.sliding not in visible:
                visible[layer.sliding] = self._cached_mask(lengths, keys.shape[2], b, layer.sliding)
            mask = visible[layer.sliding]
            if index == last and slots is not None:  # nothing reads the other outputs: query the kept alone
                x, normed, mask = x[:, kept], normed[:, kept], mask[:, :, kept]
                rope = (rope[0][:, :, kept], rope[1][:, :, kept])
            q = layer.self_attn.queries(normed, rope)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.self_attn.scaling,
                                                      enable_gqa=q.shape[1] != keys.shape[1])
            x = layer.finish(x, attended)
        return x

    def _cached_mask(self, lengths: Tensor, S: int, b: int, sliding: bool) -> Tensor:
        """[B,1,b,S] bool: what block query j of row b sees of its cache row (context at
        s < lengths[b], the block at lengths[b] + i)."""
        offset = torch.arange(S, device=lengths.device)[None, :] - lengths[:, None]  # [B,S]: s - n
        context = offset < 0
        if sliding:
            context = context & (-offset <= self.window)
        block = (offset >= 0) & (offset < b)
        seen = (context | block)[:, None, :].expand(-1, b, -1)
        if sliding and not self.config.sliding_window_non_causal:
            slot = torch.arange(b, device=lengths.device)[None, :, None]
            seen = seen & (context[:, None, :] | (offset[:, None, :] <= slot))
        return seen[:, None]

    # ------------------------------------------------------------ the whole-sequence forward
    def block_logits(self, features: Tensor, tokens: Tensor, anchors: Tensor, embedding: Tensor | None,
                     output: Tensor | None, vocab_size: int | None = None, draft_vocab: bool = False) -> Tensor:
        """Every anchor's block in one forward without a cache (training runs through this; the
        decoding forward must equal it). ``features`` [B,S,F] the target's features of each
        position, ``tokens`` [B,S] int64, ``anchors`` [B,A] int64 positions (each < S, -1 for
        none: its logits are meaningless). Block a of row b is ``[tokens[b, n], mask ...]`` at
        positions n .. n+b-1 (n = anchors[b, a]); it sees the context t < n (and, on sliding
        layers, n - t <= window) and its own block (causal on sliding layers unless
        ``sliding_window_non_causal``), never another block. ``embedding``, ``output`` [V,H]:
        the target's embedding and head weights (None where the drafter has its own). Returns
        logits [B,A,num_drafts,V] float32 (slot j's at index j - first_slot; ``draft_vocab``:
        over the draft vocabulary, else the target's of ``vocab_size``). Attention is written
        out (scores, mask, softmax), not the decoding forward's kernel."""
        B, S, _ = features.shape
        A, b = anchors.shape[1], self.block_size
        n = anchors.clamp_min(0)
        context = self.project(features)  # [B,S,H]
        block_positions = (n[..., None] + torch.arange(b, device=n.device)).view(B, A * b)
        capacity = S + b
        ctx_rope = self.rope(torch.arange(S, device=n.device).expand(B, S), context.dtype, capacity)
        blk_rope = self.rope(block_positions, context.dtype, capacity)
        x = self.embed(self.block_tokens(tokens.gather(1, n)).view(B, A * b), embedding)
        masks = {sliding: self._whole_mask(n, S, sliding) for sliding in {layer.sliding for layer in self.layers}}
        for layer in self.layers:
            attn = layer.self_attn
            normed = layer.input_layernorm(x)
            q = attn.queries(normed, blk_rope)
            k_ctx, v_ctx = attn.keys_values(context, ctx_rope)
            k_blk, v_blk = attn.keys_values(normed, blk_rope)
            keys, values = torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2)
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), keys.float()) * attn.scaling
            scores = scores.masked_fill(~masks[layer.sliding], float("-inf"))
            attended = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), values.float()).to(x.dtype)
            x = layer.finish(x, attended)
        slots = x.view(B, A, b, -1)[:, :, self.config.first_slot:]
        return self.draft_logits(slots, output) if draft_vocab else self.logits(slots, output, vocab_size)

    def _whole_mask(self, n: Tensor, S: int, sliding: bool) -> Tensor:
        """[B,1,A*b,S+A*b] bool: block a's queries see the context before its anchor n[b, a]
        and their own block only."""
        B, A = n.shape
        b = self.block_size
        t = torch.arange(S, device=n.device)
        context = t[None, None, :] < n[..., None]  # [B,A,S]
        if sliding:
            context = context & (n[..., None] - t[None, None, :] <= self.window)
        context = context[:, :, None, :].expand(B, A, b, S).reshape(B, A * b, S)
        query_block = torch.arange(A * b, device=n.device) // b
        key_block = torch.arange(A * b, device=n.device) // b
        block = query_block[:, None] == key_block[None, :]
        if sliding and not self.config.sliding_window_non_causal:
            slot = torch.arange(A * b, device=n.device)
            block = block & (slot[None, :] <= slot[:, None])
        return torch.cat([context, block.expand(B, -1, -1)], -1)[:, None]

    # ------------------------------------------------------------------ format
    def save(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the speculators ``dflash`` layout."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        c = self.config
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.reduced:
            t2d = torch.zeros(self.layer_config.vocab_size, dtype=torch.bool)
            t2d[torch.arange(c.draft_vocab_size) + self.d2t.cpu()] = True
            state["t2d"] = t2d
        config = dict(
            speculators_model_type="dflash", architectures=["DFlashSpeculator"], transformer_layer_config=c.layer,
            draft_vocab_size=c.draft_vocab_size, block_size=c.block_size, target_hidden_size=c.target_hidden_size,
            aux_hidden_state_layer_ids=list(c.layer_ids), mask_token_id=c.mask_token_id,
            sliding_window_non_causal=c.sliding_window_non_causal, sample_from_anchor=c.sample_from_anchor,
            projector_type="dflash", speculators_version="0.9.0",
            speculators_config=dict(algorithm="dflash", default_proposal_method="greedy",
                                    proposal_methods=[dict(proposal_type="greedy", speculative_tokens=c.num_drafts,
                                                           verifier_accept_k=1, accept_tolerance=0.0)],
                                    verifier=c.verifier))
        if c.num_target_layers is not None:
            config["spec_ext"] = dict(num_target_layers=c.num_target_layers)
        save_file(state, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------- loading
def dflash_kind(data: dict) -> str | None:
    """"speculators", "zlab" or None: which DFlash layout the config dict ``data`` is in.
    Raises ``ValueError`` naming DFlash variants spec_ext does not run (DFlash2, DSpark)."""
    kind = data.get("speculators_model_type")
    if kind in ("dflash2", "dspark", "dflare", "dsv4_dspark"):
        raise ValueError(f"speculators_model_type: {kind!r} is not supported (its extra modules change how the "
                         f"block is drawn; spec_ext runs DFlash's own forward only)")
    if kind == "dflash":
        return "speculators"
    if "dflash_config" in data:
        extra = [k for k in _ZLAB_DFLASH2 if k in data["dflash_config"] or k in data]
        if extra:
            raise ValueError(f"dflash_config.{extra[0]}: a DFlash2 checkpoint (dynamic convolutions and a candidate "
                             f"selector drawing the block slot by slot) is not supported")
        return "zlab"
    return None


def is_dflash_directory(path: str | Path) -> bool:
    """Whether ``path`` holds a DFlash drafter (speculators ``dflash`` or z-lab's layout)."""
    config = Path(path) / "config.json"
    return config.is_file() and dflash_kind(json.loads(config.read_text())) is not None


def load_dflash(path: str | Path, dtype: torch.dtype | None = None) -> DFlashDraft:
    """A DFlash drafter from a directory in the speculators ``dflash`` layout or z-lab's (a
    Qwen3 config with ``block_size``, ``num_target_layers`` and ``dflash_config:
    {target_layer_ids, mask_token_id}``; z-lab's id i reads HF's ``hidden_states[i + 1]``).
    Raises ``ValueError`` naming a field spec_ext cannot honour."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"draft: {path} has no config.json")
    data = json.loads((path / "config.json").read_text())
    kind = dflash_kind(data)
    if kind is None:
        raise ValueError(f"draft: {path}/config.json is not a DFlash config (no speculators_model_type 'dflash', "
                         f"no dflash_config)")
    state = {k.removeprefix("model."): v for k, v in _weights(path).items()}
    if kind == "speculators":
        config = _speculators_config(data)
    else:
        config = _zlab_config(data)
    draft = DFlashDraft(config, "embed_tokens.weight" in state)
    if draft.reduced:
        if "d2t" not in state:
            raise ValueError(f"d2t: a draft vocabulary of {config.draft_vocab_size} tokens for a target of "
                             f"{config.layer['vocab_size']} needs its map d2t")
    else:
        state.pop("d2t", None)
        state.pop("lm_head.weight", None)  # a full-vocabulary head is the target's own
    state.pop("t2d", None)
    state = {k: v for k, v in state.items() if not k.startswith(("verifier_", "rotary_emb."))}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "embed_tokens.weight"]
    if missing or unexpected:
        raise ValueError(f"draft: {path}: weights missing {missing[:6]}, unexpected {unexpected[:6]}")
    return draft.to(dtype) if dtype is not None else draft


def _speculators_config(data: dict) -> DFlashConfig:
    unknown = sorted(set(data) - _SPECULATORS_KEYS)
    if unknown:
        raise ValueError(f"{unknown[0]}: a speculators dflash field spec_ext does not know (it cannot honour it)")
    if data.get("projector_type", "dflash") != "dflash":
        raise ValueError(f"projector_type: {data['projector_type']!r} is not supported (only 'dflash'; Domino's "
                         f"correction head is not)")
    if data.get("shift_label"):
        raise ValueError("shift_label: true (targets shifted by one, a Domino recipe) is not supported")
    if data.get("aux_hidden_state_layer_ids") is None:
        raise ValueError("aux_hidden_state_layer_ids: missing (spec_ext needs the target layers the drafter read)")
    return DFlashConfig(dict(data["transformer_layer_config"]), data.get("block_size", 8),
                        data["aux_hidden_state_layer_ids"], data.get("mask_token_id"), data.get("draft_vocab_size"),
                        data.get("target_hidden_size"), bool(data.get("sample_from_anchor", False)),
                        bool(data.get("sliding_window_non_causal", False)),
                        (data.get("spec_ext") or {}).get("num_target_layers"),
                        (data.get("speculators_config") or {}).get("verifier") or
                        dict(name_or_path=None, architectures=[]))


def _zlab_config(data: dict) -> DFlashConfig:
    extra = dict(data.get("dflash_config") or {})
    for name, neutral in _ZLAB_NEUTRAL.items():
        value = extra.get(name, data.get(name, neutral))
        if value != neutral and not (neutral is None and not value):
            raise ValueError(f"dflash_config.{name}: {value!r} is not supported (spec_ext runs it as {neutral!r})")
    if extra.get("is_causal", data.get("is_causal")):
        raise ValueError("is_causal: a causal block is not supported (DFlash attends within its block both ways)")
    if "sliding_attention" in (data.get("layer_types") or []) and data.get("use_sliding_window"):
        raise ValueError("layer_types: sliding layers of a z-lab checkpoint (its window is per query, the "
                         "speculators library's per anchor) are not supported; convert it to the speculators layout")
    ids = extra.get("target_layer_ids", data.get("target_layer_ids"))
    if ids is None:
        raise ValueError("dflash_config.target_layer_ids: missing")
    layer = {k: v for k, v in data.items() if k not in ("dflash_config", "block_size", "num_target_layers",
                                                        "architectures", "auto_map", "target_layer_ids",
                                                        "mask_token_id", "torch_dtype", "dtype",
                                                        "transformers_version")}
    layer.setdefault("model_type", "qwen3")
    return DFlashConfig(layer, int(extra.get("block_size", data.get("block_size", 16))),
                        [int(i) + 1 for i in ids], extra.get("mask_token_id", data.get("mask_token_id")),
                        num_target_layers=data.get("num_target_layers"))
