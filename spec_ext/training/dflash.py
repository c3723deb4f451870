"""Training a DFlash block drafter for a target (``python -m spec_ext train-dflash``).

The recipe of DFlash (arXiv 2602.06036) and vLLM's ``speculators``, on what one CPU affords:

1. data (:mod:`spec_ext.training.corpus`, as for heads): the target's own greedy continuations
   of prompts cut from the given texts, and one target forward per sequence tapping the
   drafter's layers ``layer_ids`` and the target's last hidden state (its distribution is
   recomputed from it per batch); both cached;
2. random anchors: each step draws ``anchors`` positions n per sequence in the continuation
   (n >= prompt_tokens - 1, so every label is the target's own text) from a generator seeded
   by the step, so a resumed run draws what an uninterrupted one does. Each anchor's block
   ``[x_n, mask x (b-1)]`` sees the target's features of positions t < n only and its own
   block, all blocks of a sequence in one forward (:meth:`DFlashDraft.block_logits`);
3. the loss: slot j (1 <= j < b) of the anchor at n drafts the token at n + j. ``loss="ce"``
   (speculators' DFlash loss): the cross-entropy to the target's greedy token there, which is
   the continuation's own token (no target compute at all); ``"kl"``: to the target's
   distribution p(. | x_<=n+j-1) (its logits at position n+j-1, recomputed from the cached last
   hidden state) over the draft vocabulary. Slot j is weighted by ``exp(-(j-1)/gamma)``
   (speculators' and DFlash's decay: the early slots decide how many drafts a round keeps),
   averaged over the slots whose label exists;
4. initialisation from the target's own last layers (attention, MLP and norms), ``norm`` and
   the output head the target's, ``fc`` passing the copied first layer's own input through;
   ``init``: "copied" leaves it there (Qwen3's q/k norms as ones), "calibrated" gives
   ``hidden_norm`` and the q/k norms the target layer's scales, "focused" (the default) also
   aims the mask token's queries at the positions slot 1 predicts from
   (:func:`calibrate_to_target`); the mask token is the least frequent token of the data with
   a non-zero embedding (its row of the target's embedding is the mask's embedding);
   or ``init_from``: a drafter trained before (a finished run's ``out``), continued with a new schedule, with
   ``layers`` beyond its own appended as identities (:func:`grown_dflash`);
5. a draft vocabulary of the ``draft_vocab`` most frequent tokens of the data (when set);
6. checkpoints every ``checkpoint_every`` steps (drafter, optimiser, step; a rerun resumes to
   the weights an uninterrupted run reaches) and the held-out agreement printed: each slot's
   argmax against the target's greedy token, and the drafts a greedy round would accept per
   block size.

Example:
    >>> draft = train_dflash(target, tokenizer, files, "out/dflash", work="out/work")  # doctest: +SKIP
"""
from __future__ import annotations

import json
import math
import time
import dataclasses
import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from spec_ext.models import num_layers
from spec_ext.models.dflash import DFlashConfig, DFlashDraft, load_dflash
from spec_ext.models.eagle import _linear, _rotate
from spec_ext.training.corpus import (cosine_lr, frequent_tokens, frozen_float32, load_checkpoint, on_policy_splits,
                                      save_checkpoint)


@dataclass
class DFlashTraining:
    """The settings of :func:`train_dflash`."""
    sequences: int = 1024  # on-policy training sequences (prompt + continuation)
    validation_sequences: int = 64
    prompt_tokens: int = 128
    new_tokens: int = 128
    steps: int = 2000
    batch: int = 8  # sequences per step
    anchors: int = 32  # blocks per sequence per step
    block_size: int = 16
    layers: int = 1  # the drafter's decoder layers
    gamma: float = 4.0  # slot j's loss weight: exp(-(j-1)/gamma)
    loss: str = "ce"  # "ce": to the target's greedy tokens; "kl": to its distributions
    lr: float = 1e-3
    warmup: int = 50
    draft_vocab: int | None = None  # None: the target's whole vocabulary (through its own head)
    init: str = "focused"  # "copied", "calibrated" or "focused": see initial_dflash and calibrate_to_target
    init_from: str | None = None  # a saved drafter to go on from (its function; see grown_dflash), not init
    layer_ids: tuple[int, ...] | None = None  # None: default_layer_ids(L)
    validate_every: int = 250
    checkpoint_every: int = 250
    seed: int = 0


def default_layer_ids(layers: int) -> tuple[int, ...]:
    """Four target hidden states (HF's ``hidden_states[k]``) spread evenly from k = 2 to the last
    layer's input k = L-1 (fewer for shallow targets): (2, 4, 6, 7) for L = 8."""
    return tuple(sorted({math.ceil(2 + i * (layers - 3) / 3) for i in range(4)}))


def slot_weights(block_size: int, gamma: float) -> Tensor:
    """[b-1] float32: the loss weight of slots j = 1 .. b-1, exp(-(j-1)/gamma)."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def slot_positions(anchors: Tensor, block_size: int, length: int) -> tuple[Tensor, Tensor]:
    """Where slot j = 1 .. b-1 of the anchor at n (``anchors`` [B,A]) drafts: position n + j
    [B,A,b-1] int64 (clamped into the sequence), and whether it is inside the sequences of
    ``length`` tokens [B,A,b-1] bool. Its label is the token there, which the target's
    distribution at n + j - 1 predicts."""
    at = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)
    return at.clamp(0, length - 1), (at <= length - 1) & (anchors[..., None] >= 0)


def at_positions(values: Tensor, positions: Tensor) -> Tensor:
    """``values`` [B,S,...] taken at ``positions`` [B,...] of its row -> [B,...,...]."""
    B = values.shape[0]
    flat = positions.reshape(B, -1)
    index = flat.view(B, -1, *([1] * (values.dim() - 2))).expand(-1, -1, *values.shape[2:])
    return values.gather(1, index).view(*positions.shape, *values.shape[2:])


def draw_anchors(rows: int, length: int, first: int, count: int, generator: torch.Generator) -> Tensor:
    """[rows, count] int64 anchor positions, sorted, drawn without replacement per row from
    ``first .. length-2`` (every anchor has at least one label), with ``generator``."""
    choices = length - 1 - first
    if choices < 1:
        raise ValueError(f"new_tokens: sequences of {length} tokens leave no anchor after position {first}")
    count = min(count, choices)
    order = torch.rand(rows, choices, generator=generator).argsort(-1)[:, :count]
    return (order + first).sort(-1).values


def initial_dflash(target, layer_ids: tuple[int, ...], layers: int, block_size: int, mask_token_id: int,
                   draft_ids: Tensor | None = None, seed: int = 0) -> DFlashDraft:
    """A DFlash drafter of ``layers`` Qwen3 layers of the target's shape for ``target``,
    initialised from the target's last ``layers`` layers where their weights fit (see the module
    docstring), over the draft vocabulary ``draft_ids`` (ascending target ids; None: the
    target's own output head)."""
    text = target.config.get_text_config()
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings", "vocab_size",
            "attention_bias", "hidden_act", "tie_word_embeddings")
    layer = {k: v for k in keys if (v := getattr(text, k, None)) is not None}
    layer.update(model_type="qwen3", num_hidden_layers=layers)
    layer.setdefault("num_key_value_heads", text.num_attention_heads)
    layer.setdefault("rms_norm_eps", getattr(text, "layer_norm_eps", 1e-6))
    layer.setdefault("intermediate_size", 4 * text.hidden_size)
    config = DFlashConfig(layer, block_size, tuple(layer_ids), mask_token_id,
                          None if draft_ids is None else len(draft_ids), text.hidden_size,
                          verifier=dict(name_or_path=getattr(target.config, "_name_or_path", None) or None,
                                        architectures=list(getattr(target.config, "architectures", None) or [])))
    torch.manual_seed(seed)
    draft = DFlashDraft(config)
    for module in draft.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
    H = text.hidden_size
    own = getattr(getattr(target, "model", None), "layers", None)
    copied = own is not None and len(own) >= layers
    first = len(own) - layers if copied else None  # the target layer the drafter's first layer copies
    passed = layer_ids.index(first) if first in layer_ids else len(layer_ids) - 1
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, passed * H:(passed + 1) * H] = torch.eye(H)  # the copied layer's input, passed through
        if draft.reduced:
            draft.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
            draft.lm_head.weight.copy_(target.get_output_embeddings().weight.detach().float()[draft_ids])
        if copied:
            for mine, theirs in zip(draft.layers, own[first:]):
                shapes = {k: v.shape for k, v in mine.state_dict().items()}
                mine.load_state_dict({k: v.detach().float() for k, v in theirs.state_dict().items()
                                      if shapes.get(k) == v.shape}, strict=False)  # q/k norms: Qwen3's own
        norm = getattr(getattr(target, "model", None), "norm", None)
        if getattr(norm, "weight", None) is not None and norm.weight.shape == draft.norm.weight.shape:
            draft.norm.weight.copy_(norm.weight.detach().float())
    return draft


def grown_dflash(source: DFlashDraft, layers: int) -> DFlashDraft:
    """``source`` with ``layers`` decoder layers (at least its own): its own first, then copies of
    its last with ``o_proj`` and ``down_proj`` zeroed, so each added layer adds nothing to the
    residual stream and the grown drafter computes exactly what ``source`` does; training then
    starts from there (the added layers' attention and MLP learn once their outputs move off zero)."""
    have = source.num_layers
    if layers < have:
        raise ValueError(f"layers: {layers}, fewer than the {have} layers of the drafter in init_from")
    layer = dict(source.config.layer, num_hidden_layers=layers)
    types = layer.get("layer_types")
    if types is not None:
        layer["layer_types"] = list(types[:have]) + [types[have - 1]] * (layers - have)
    config = dataclasses.replace(source.config, layer=layer)
    grown = DFlashDraft(config, own_embeddings=source.embed_tokens is not None).to(source.fc.weight.dtype)
    state = source.state_dict()
    last = f"layers.{have - 1}."
    for i in range(have, layers):
        state |= {f"layers.{i}.{k[len(last):]}": v.clone() for k, v in source.state_dict().items()
                  if k.startswith(last)}
        state[f"layers.{i}.self_attn.o_proj.weight"].zero_()
        state[f"layers.{i}.mlp.down_proj.weight"].zero_()
        for bias in (f"layers.{i}.self_attn.o_proj.bias", f"layers.{i}.mlp.down_proj.bias"):
            if bias in state:
                state[bias].zero_()
    grown.load_state_dict(state)
    return grown


# the mask queries' scale over the target's. On the bundled target (source text, anchors 12-39)
# slot 1's heads aimed at n - 1 put 0.044 of their attention there (copied: 0.022); the heads
# aimed at the anchor do not gain (0.053 against 0.067). Trained 200 steps (512 continuations),
# the focused drafter is accepted 0.31 per round, the copied one 0.19 (docs/block_drafters.md).
FOCUS_SHARPNESS = 4.0


@torch.no_grad()
def calibrate_to_target(draft: DFlashDraft, target, features: Tensor, tokens: Tensor, focus: bool = True) -> None:
    """Make the drafter's first layer (copied from the target's layer ``L - layers`` by
    :func:`initial_dflash`, whose input ``fc`` passes through) attend as that layer does, on
    ``features`` [N,S,F] and ``tokens`` [N,S] of the data:

    * ``hidden_norm`` takes that layer's ``input_layernorm`` weight, so the context keys and
      values are the target layer's own on its input (up to the per-head RMS of ``k_norm``);
    * ``q_norm``/``k_norm`` (Qwen3's, absent from a Llama layer) take per-dimension scales that
      give the queries and keys the target's mean square there, so scores keep its sharpness;
    * ``focus``: the mask token's query (the b - 1 mask slots all share its content) becomes,
      per head, the matched filter of the mean key at a fixed offset under the rotary embedding:
      even heads of each key group peak two positions back (slot 1 sees context n - 1), odd heads
      one back (slot 1 sees the anchor), through a rank-1 change of ``q_proj`` along the mask
      embedding, and the queries scaled by ``FOCUS_SHARPNESS`` (a one-layer drafter's queries are
      the block's only: the anchor slot's output is no draft). A mask slot otherwise starts with
      a query unrelated to where its inputs are.
    Drafters with no copied layer (``fc`` not a pass-through of a target layer) are left as
    they are."""
    own = getattr(getattr(target, "model", None), "layers", None)
    if own is None or len(own) < draft.num_layers:
        return
    theirs, mine = own[len(own) - draft.num_layers], draft.layers[0]
    norm = getattr(theirs, "input_layernorm", None)
    if getattr(norm, "weight", None) is None or norm.weight.shape != draft.hidden_norm.weight.shape:
        return
    attn = mine.self_attn
    D = attn.head_dim
    draft.hidden_norm.weight.copy_(norm.weight.detach().float())
    context = draft.project(features.float()).flatten(0, 1)  # [N*S,H]: the target layer's normed input
    for projection, scale in ((attn.q_proj, attn.q_norm), (attn.k_proj, attn.k_norm)):
        raw = _linear(projection, context).view(len(context), -1, D)
        normed = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + scale.eps)
        scale.weight.copy_((raw.pow(2).mean((0, 1)) / normed.pow(2).mean((0, 1)).clamp_min(1e-12)).sqrt())
    if not focus:
        return
    embedding = target.get_input_embeddings().weight.detach().float()
    anchors = mine.input_layernorm(F.embedding(tokens.flatten(), embedding))
    keys = {name: attn.k_norm(_linear(attn.k_proj, x).view(len(x), -1, D)).mean(0)  # [Hkv,D] pre-rotary
            for name, x in (("context", context), ("anchor", anchors))}
    cos, sin = draft.rope(torch.arange(3)[None], torch.float32, 3)  # [1,1,3,D]
    heads = attn.q_proj.out_features // D
    group = heads // keys["context"].shape[0]
    wanted = torch.empty(heads, D)
    for h in range(heads):
        back = 2 if h % 2 == 0 else 1  # positions from slot 1 back to the key it should see
        key = keys["context" if back == 2 else "anchor"][h // group]
        wanted[h] = _rotate(key, cos[0, 0, back], -sin[0, 0, back])  # q* = R(-back) k: q*.R(-back)k is largest
    mask = mine.input_layernorm(embedding[draft.config.mask_token_id])
    if not mask.abs().sum() > 0:
        raise ValueError(f"mask_token_id: token {draft.config.mask_token_id}'s embedding is all zeros (a padding row?): "
                         "the mask slots' queries cannot be focused; pick a token with an embedding")
    current = _linear(attn.q_proj, mask).view(heads, D)
    raw = wanted / attn.q_norm.weight.clamp_min(1e-6)  # q_norm(raw) is wanted up to a positive scale
    raw = raw * (current.pow(2).mean(-1, keepdim=True) / raw.pow(2).mean(-1, keepdim=True).clamp_min(1e-12)).sqrt()
    attn.q_proj.weight.add_(torch.outer((raw - current).flatten(), mask / mask.dot(mask)))
    attn.q_norm.weight.mul_(FOCUS_SHARPNESS)


def block_losses(draft: DFlashDraft, target, batch: tuple[Tensor, Tensor, Tensor], anchors: Tensor,
                 loss: str = "ce") -> tuple[Tensor, Tensor, Tensor]:
    """Each slot's loss and whether the drafter's argmax is the target's, for the blocks at
    ``anchors`` [B,A] of ``batch`` (tokens [B,S] the target's greedy continuations, features
    [B,S,F], the target's last hidden state [B,S,H]).

    ``loss``: ``"ce"`` the cross-entropy to the target's greedy token (the text's own token at
    n + j; a token outside the draft vocabulary has no loss), ``"kl"`` to the target's
    distribution at n + j - 1 over the draft vocabulary (its KL up to the target's entropy).
    Returns losses [B,A,b-1] float32, agree [B,A,b-1] bool (with the text's token) and exists
    [B,A,b-1] bool (a label to learn: losses and agree mean nothing elsewhere)."""
    tokens, features, last = batch
    if loss not in ("ce", "kl"):
        raise ValueError(f"loss: 'ce' or 'kl', got {loss!r}")
    embedding = None if draft.embed_tokens is not None else target.get_input_embeddings().weight
    output = None if draft.reduced else target.get_output_embeddings().weight
    draft_ids = (torch.arange(draft.config.draft_vocab_size, device=tokens.device)
                 + (draft.d2t if draft.reduced else 0))
    positions, exists = slot_positions(anchors, draft.block_size, tokens.shape[1])
    labels = at_positions(tokens, positions)
    logits = draft.block_logits(features.float(), tokens, anchors, embedding, output, draft_vocab=True)
    agree = draft_ids[logits.argmax(-1)] == labels
    if loss == "ce":
        to_draft = torch.full((draft.layer_config.vocab_size,), -1, dtype=torch.int64, device=tokens.device)
        to_draft[draft_ids] = torch.arange(len(draft_ids), device=tokens.device)
        index = to_draft[labels]
        exists = exists & (index >= 0)
        losses = F.cross_entropy(logits.flatten(0, -2), index.clamp_min(0).flatten(), reduction="none"
                                 ).view(index.shape)
    else:
        with torch.no_grad():
            target_logits = target.get_output_embeddings()(at_positions(last, positions - 1).float())
            target_p = F.softmax(target_logits[..., draft_ids], -1)
        losses = -(target_p * F.log_softmax(logits, -1)).sum(-1)
    return losses, agree, exists


def weighted_loss(losses: Tensor, exists: Tensor, weights: Tensor) -> Tensor:
    """sum(losses * weights[slot]) over the existing labels / their count (speculators' mean)."""
    mask = exists.float()
    return (losses * mask * weights).sum() / mask.sum().clamp_min(1.0)


@torch.no_grad()
def block_agreement(draft: DFlashDraft, target, data: tuple[Tensor, Tensor, Tensor], first: int,
                    block_sizes: tuple[int, ...] = (4, 8, 16), gamma: float = 4.0, loss: str = "ce",
                    batch: int = 8) -> dict:
    """The drafter on ``data`` (tokens the target's greedy continuations, features, last), at
    every anchor n >= ``first`` whose whole block has labels: ``loss`` the mean weighted loss
    (:func:`weighted_loss` of :func:`block_losses`, slot weights of ``gamma``), ``slots[j-1]``
    slot j's agreement with the target's greedy token (unconditional), ``accepted_per_round[b]``
    the mean run of agreeing slots of a block of b (its first b - 1 drafts; ``block_sizes`` up
    to the drafter's, and its own): what a greedy round of that block accepts."""
    b = draft.block_size
    S = data[0].shape[1]
    if S - b < first:
        raise ValueError(f"data: sequences of {S} tokens hold no whole block of {b} after position {first}")
    weights = slot_weights(b, gamma)
    anchors = torch.arange(first, S - b + 1)
    runs, slots, count = torch.zeros(b, dtype=torch.float64), torch.zeros(b - 1, dtype=torch.float64), 0
    total, labels = 0.0, 0.0
    for i in range(0, len(data[0]), batch):
        part = tuple(x[i:i + batch] for x in data)
        rows = anchors.expand(len(part[0]), -1)
        for j in range(0, rows.shape[1], 32):  # anchors in chunks: the forward's scores are [A*b, S+A*b]
            losses, agree, exists = block_losses(draft, target, part, rows[:, j:j + 32].contiguous(), loss)
            total += float((losses * exists * weights).sum())
            labels += float(exists.sum())
            run = agree.int().cumprod(-1)  # [B,A,b-1]: slot j and every one before it agree
            runs += torch.bincount(run.sum(-1).flatten(), minlength=b).double()
            slots += agree.double().sum((0, 1))
            count += agree.shape[0] * agree.shape[1]
    at_least = runs.flip(0).cumsum(0).flip(0) / max(1, count)  # P(run >= j)
    sizes = sorted({k for k in block_sizes if k <= b} | {b})
    return dict(loss=total / max(1.0, labels), slots=[float(s / max(1, count)) for s in slots],
                accepted_per_round={k: float(at_least[1:k].sum()) for k in sizes},
                positions=count)


def check_continued(settings: DFlashTraining, source: DFlashDraft, layer_ids: tuple[int, ...], target) -> None:
    """A ``ValueError`` naming the setting where these settings cannot go on training ``source``
    (``init_from``) for ``target``: a drafter for another target (its vocabulary, its features'
    width), another block size, other target layers, another draft vocabulary size (the
    drafter keeps its own vocabulary and mask token); fewer layers: :func:`grown_dflash`."""
    config, text = source.config, target.config.get_text_config()
    if config.layer["vocab_size"] != text.vocab_size:
        raise ValueError(f"init_from: the drafter's vocabulary has {config.layer['vocab_size']} tokens, the target's "
                         f"{text.vocab_size}")
    if source.feature_width != len(config.layer_ids) * text.hidden_size:
        raise ValueError(f"init_from: the drafter reads features {source.feature_width} wide, the target's "
                         f"{len(config.layer_ids)} layers give {len(config.layer_ids) * text.hidden_size}")
    if config.block_size != settings.block_size:
        raise ValueError(f"block_size: {settings.block_size}, the drafter in init_from has {config.block_size}")
    if tuple(sorted(config.layer_ids)) != layer_ids:
        raise ValueError(f"layer_ids: {list(layer_ids)}, the drafter in init_from reads {list(config.layer_ids)}")
    theirs = config.draft_vocab_size if source.d2t is not None else None
    if (settings.draft_vocab if settings.draft_vocab is None or settings.draft_vocab < config.layer["vocab_size"]
            else None) != theirs:
        raise ValueError(f"draft_vocab: {settings.draft_vocab}, the drafter in init_from has "
                         f"{theirs or 'the target vocabulary'}")


def train_dflash(target, tokenizer, files: list[Path], out: str | Path, work: str | Path,
                 settings: DFlashTraining | None = None, validation_files: list[Path] | None = None,
                 log=print, deadline: float | None = None) -> DFlashDraft:
    """Train a DFlash drafter for ``target`` (converted to float32 in place, frozen) on its
    continuations of prompts cut from ``files`` (see the module docstring); save it at ``out``
    in the speculators layout and return it. Everything slow is cached or checkpointed under
    ``work``: a rerun resumes. ``validation_files`` (default: ``files`` with another seed) give
    the held-out sequences. ``deadline`` (a ``time.time()`` value): stop after the first step past
    it (validated and checkpointed there; the learning rate is then where the schedule of
    ``settings.steps`` has it), for a job that must end by a given time."""
    settings = settings or DFlashTraining()
    started = time.perf_counter()
    if not files:
        raise ValueError("data: no training files")
    if settings.sequences < settings.batch:
        raise ValueError(f"batch: {settings.batch} sequences per step, more than the {settings.sequences} sequences")
    if settings.block_size < 2:
        raise ValueError(f"block_size: {settings.block_size} slots propose no draft (at least 2)")
    if settings.gamma <= 0:
        raise ValueError(f"gamma: the slot weights' decay must be positive, got {settings.gamma}")
    if settings.init not in ("copied", "calibrated", "focused"):
        raise ValueError(f"init: 'copied', 'calibrated' or 'focused', got {settings.init!r}")
    if settings.new_tokens < 2:
        raise ValueError(f"new_tokens: {settings.new_tokens}; anchors need at least 2 continued tokens")
    work, out = Path(work), Path(out)
    work.mkdir(parents=True, exist_ok=True)
    target = frozen_float32(target)
    layer_ids = tuple(sorted(settings.layer_ids or default_layer_ids(num_layers(target))))
    bad = [k for k in layer_ids if not 0 <= k <= num_layers(target)]
    if bad:
        raise ValueError(f"layer_ids: {list(layer_ids)} names layers {bad} the target does not have")
    vocab = target.config.get_text_config().vocab_size
    draft = None
    if settings.init_from is not None:  # checked before the data is made (minutes)
        settings = dataclasses.replace(settings, init_from=str(Path(settings.init_from).resolve()))
        source = load_dflash(settings.init_from, torch.float32)
        check_continued(settings, source, layer_ids, target)
        draft = grown_dflash(source, settings.layers)
        draft_ids = None if source.d2t is None else source.d2t + torch.arange(len(source.d2t))
    data = on_policy_splits(target, tokenizer, files, validation_files, layer_ids, work, settings.sequences,
                            settings.validation_sequences, settings.prompt_tokens, settings.new_tokens, settings.seed)
    if draft is None:
        counts = torch.bincount(data["train"][0].flatten(), minlength=vocab)
        # the least frequent token whose embedding is not all zeros (a padding row: a mask slot's input would be 0)
        embedded = target.get_input_embeddings().weight.detach()[:vocab].abs().sum(-1) > 0
        counts = torch.where(embedded, counts, counts.max() + 1)
        mask_token_id = int(torch.sort(counts, stable=True).indices[0])
        draft_ids = None
        if settings.draft_vocab is not None and settings.draft_vocab < vocab:
            draft_ids = frequent_tokens(data["train"][0], settings.draft_vocab, vocab)
        draft = initial_dflash(target, layer_ids, settings.layers, settings.block_size, mask_token_id, draft_ids,
                               settings.seed)
        if settings.init != "copied":
            calibrate_to_target(draft, target, data["train"][1][:64], data["train"][0][:64],
                                focus=settings.init == "focused")
    if draft_ids is not None:
        covered = torch.isin(data["validation"][0][:, settings.prompt_tokens:], draft_ids).float().mean()
        log(f"draft vocabulary: {len(draft_ids)} of {vocab} tokens cover {covered:.1%} of the held-out "
            f"continuations")
    trained = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    weights = slot_weights(settings.block_size, settings.gamma)
    # a continued run checkpoints apart, keyed by its settings, so it can share a work directory (its cached data)
    # with the run before and with other continuations
    key = hashlib.sha256(json.dumps(asdict(settings), sort_keys=True).encode()).hexdigest()[:8]
    name = "dflash_checkpoint.pt" if settings.init_from is None else \
        f"dflash_checkpoint_from_{Path(settings.init_from).name}_{key}.pt"
    checkpoint, step, before = work / name, 0, 0.0
    history: list[dict] = []
    state = load_checkpoint(checkpoint, asdict(settings))
    if state is not None:
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        step, history, before = state["step"], state["history"], state["seconds"]
        log(f"resumed at step {step}")

    def elapsed() -> float:  # this run's seconds (data included) plus those before a resume
        return before + time.perf_counter() - started

    def validate():
        draft.eval()
        result = block_agreement(draft, target, data["validation"], settings.prompt_tokens - 1,
                                 gamma=settings.gamma, loss=settings.loss)
        draft.train()
        history.append(dict(step=step, seconds=round(elapsed()), **result))
        slots = " ".join(f"{s:.2f}" for s in result["slots"])
        accepted = ", ".join(f"b={k} {v:.2f}" for k, v in result["accepted_per_round"].items())
        log(f"step {step}: loss {result['loss']:.3f}, slot agreement {slots}; accepted per round {accepted} "
            f"(held-out, teacher forced; {elapsed():.0f} s)")

    if step == 0:
        validate()
    tokens, features, last = data["train"]
    per_epoch = len(tokens) // settings.batch
    draft.train()
    with tqdm(total=settings.steps, initial=step, desc="train dflash") as bar:
        while step < settings.steps:
            epoch, index = divmod(step, per_epoch)
            order = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(settings.seed + epoch))
            rows = order[index * settings.batch:(index + 1) * settings.batch]
            anchors = draw_anchors(len(rows), tokens.shape[1], settings.prompt_tokens - 1, settings.anchors,
                                   torch.Generator().manual_seed(settings.seed * 1_000_003 + step))
            losses, agree, exists = block_losses(draft, target, (tokens[rows], features[rows], last[rows]), anchors,
                                                  settings.loss)
            loss = weighted_loss(losses, exists, weights)
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, settings.lr, settings.warmup, settings.steps)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            optimizer.step()
            step += 1
            first = float(agree[..., 0][exists[..., 0]].float().mean())
            bar.set_postfix(loss=f"{loss.item():.3f}", slot1=f"{first:.3f}")
            bar.update()
            if step % settings.validate_every == 0 or step == settings.steps:
                validate()
            stop = deadline is not None and time.time() >= deadline
            if stop and step % settings.validate_every != 0 and step != settings.steps:
                validate()
            if step % settings.checkpoint_every == 0 or step == settings.steps or stop:
                save_checkpoint(checkpoint, asdict(settings), draft=draft.state_dict(),
                                optimizer=optimizer.state_dict(), step=step, history=history, seconds=elapsed())
            if stop:
                log(f"deadline reached: stopped at step {step} of {settings.steps}")
                break
    draft.eval()
    draft.save(out)
    record = dict(settings=asdict(settings), history=history, earlier_runs=earlier_runs(settings.init_from))
    (out / "training.json").write_text(json.dumps(record, indent=2))
    return draft


def earlier_runs(init_from: str | None) -> list[dict]:
    """The runs a drafter continued from ``init_from`` came from, oldest first: that drafter's
    own ``earlier_runs`` and its run ({settings, history} from its training.json); [] without
    a source, or for a source that has no training.json (a drafter trained elsewhere)."""
    if init_from is None or not (Path(init_from) / "training.json").is_file():
        return []
    source = json.loads((Path(init_from) / "training.json").read_text())
    return source.get("earlier_runs", []) + [dict(settings=source["settings"], history=source["history"])]
