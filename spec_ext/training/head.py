"""Training an EAGLE-3 feature head for a target (``python -m spec_ext train-head``).

The recipe of EAGLE-3 and vLLM's ``speculators``, with what pays when compute is short:

1. data: the target's own greedy continuations of prompts cut from the given texts (on-policy:
   the text the head will be asked to predict), generated once and cached;
2. features: one target forward per sequence taps the head's layers and the last hidden state;
   the target's full distribution is recomputed from that state per batch (one matmul, and
   a twelfth of the storage of its logits); cached;
3. initialisation from the target's own last layer: the attention's feature half, the MLP and
   the norms are the target's last layer's, ``norm`` and ``lm_head`` the target's (over the draft
   vocabulary), ``fc`` passes the deepest tapped layer through;
4. the training-time test: the head unrolled ``ttt`` steps on its own outputs (step s weighted
   ``decay**s``); at step s the query at t drafts token t+2+s, attending to the real prefix up
   to t and to its own earlier steps at t, exactly the chain it drafts at inference; the loss is
   the cross-entropy against the target's distribution over the draft vocabulary;
5. a draft vocabulary of the ``draft_vocab`` most frequent tokens of the data (when set);
6. checkpoints every ``checkpoint_every`` steps (head, optimiser, step; a rerun resumes) and
   the head's agreement with the target on held-out sequences, printed.

Example:
    >>> head = train_head(target, tokenizer, files, "out/head", work="out/work")  # doctest: +SKIP
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from spec_ext.models import aux_layer_ids, num_layers
from spec_ext.models.eagle import LAYER_TYPES, EagleHead, HeadConfig
from spec_ext.training.corpus import (cosine_lr, frequent_tokens, frozen_float32, load_checkpoint, on_policy_splits,
                                      save_checkpoint)


@dataclass
class HeadTraining:
    """The settings of :func:`train_head`."""
    sequences: int = 1024  # on-policy training sequences (prompt + continuation)
    validation_sequences: int = 64
    prompt_tokens: int = 128
    new_tokens: int = 128
    steps: int = 2000
    batch: int = 8  # sequences per step
    ttt: int = 3  # training-time-test steps
    decay: float = 0.8  # weight of step s: decay**s
    lr: float = 1e-3
    warmup: int = 50
    draft_vocab: int | None = None  # None: the target's whole vocabulary
    layer_ids: tuple[int, ...] | None = None  # None: vLLM's (2, L//2, L-3)
    validate_every: int = 250
    checkpoint_every: int = 250
    seed: int = 0


def initial_head(target, layer_ids: tuple[int, ...], draft_ids: Tensor | None = None, seed: int = 0) -> EagleHead:
    """A one-layer EAGLE-3 head for ``target``, initialised from its last layer where the
    target's layers are of a family the head can be made of (else a Llama layer of its shape,
    freshly initialised), over the draft vocabulary ``draft_ids`` (ascending target ids)."""
    text = target.config.get_text_config()
    family = text.model_type if text.model_type in LAYER_TYPES else "llama"
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings", "vocab_size",
            "attention_bias", "hidden_act", "tie_word_embeddings")
    layer = {k: v for k in keys if (v := getattr(text, k, None)) is not None}  # attribute maps: GPT-2's n_embd
    layer.update(model_type=family, num_hidden_layers=1)
    layer.setdefault("num_key_value_heads", text.num_attention_heads)
    layer.setdefault("rms_norm_eps", getattr(text, "layer_norm_eps", 1e-6))
    layer.setdefault("intermediate_size", 4 * text.hidden_size)
    vocab = text.vocab_size
    draft_ids = torch.arange(vocab) if draft_ids is None else draft_ids
    config = HeadConfig("eagle3", layer, len(draft_ids), tuple(layer_ids), text.hidden_size,
                        verifier=dict(name_or_path=getattr(target.config, "_name_or_path", None) or None,
                                      architectures=list(getattr(target.config, "architectures", None) or [])))
    torch.manual_seed(seed)
    head = EagleHead(config)
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
    head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    H = text.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, -H:] = torch.eye(H)  # the deepest tapped layer, passed through
        head.lm_head.weight.copy_(target.get_output_embeddings().weight.detach().float()[draft_ids])
        own = _last_layer(target)
        if own is not None and family == text.model_type:
            mine = head.layers[0]
            state = {k: v.detach().float() for k, v in own.state_dict().items()}
            for name in ("q_proj", "k_proj", "v_proj"):
                proj = getattr(mine.self_attn, name)
                proj.weight[:, H:] = state[f"self_attn.{name}.weight"]
                if proj.bias is not None and f"self_attn.{name}.bias" in state:
                    proj.bias.copy_(state[f"self_attn.{name}.bias"])
            rest = {k: v for k, v in state.items() if not k.startswith(("self_attn.q_proj", "self_attn.k_proj",
                                                                      "self_attn.v_proj", "input_layernorm"))}
            mine.load_state_dict(rest, strict=False)
            mine.hidden_norm.weight.copy_(state["input_layernorm.weight"])
            final_norm = _final_norm(target)
            if final_norm is not None:
                head.norm.weight.copy_(final_norm.weight.detach().float())
    return head


def _last_layer(target):
    layers = getattr(getattr(target, "model", None), "layers", None)
    return layers[-1] if layers is not None and len(layers) else None


def _final_norm(target):
    norm = getattr(getattr(target, "model", None), "norm", None)
    return norm if norm is not None and hasattr(norm, "weight") else None


def _step_mask(n: int, step: int, device) -> Tensor:
    """[n, (step+1)*n] bool: step ``step``'s query at t sees the real prefix up to t and its own
    earlier steps at t."""
    t = torch.arange(n, device=device)
    blocks = [t[None, :] <= t[:, None]] + [t[None, :] == t[:, None]] * step
    return torch.cat(blocks, 1)


def unroll(head: EagleHead, embed: torch.nn.Module, tokens: Tensor, features: Tensor, steps: int) -> list[Tensor]:
    """The head unrolled ``steps`` steps over whole sequences, the training-time test.

    tokens [B,T] int64, features [B,T,A*H] the target's. Position t (t < T-1) pairs feature
    t with token t+1; step s feeds token t+1+s (0 past the end) and the head's own output of
    step s-1 at t. Returns, per step, the head's normed output [B,T-1,H] (``lm_head`` of it
    drafts token t+2+s)."""
    B, T = tokens.shape
    n = T - 1
    positions = torch.arange(n, device=tokens.device)
    hidden = head.combine(features[:, :n])
    padded = F.pad(tokens, (0, steps))
    keys: list[list[Tensor]] = [[] for _ in head.layers]
    values: list[list[Tensor]] = [[] for _ in head.layers]
    outputs = []
    for s in range(steps):
        embeds = embed(padded[:, 1 + s:1 + s + n])
        rope = head.rope((positions + s)[None].expand(B, -1), hidden.dtype, n + steps)
        mask = _step_mask(n, s, tokens.device)
        x = hidden
        for index, layer in enumerate(head.layers):
            inputs, residual = layer.inputs(x, embeds, head.config.norm_before_residual)
            attention = layer.self_attn
            q, k, v = attention.project(inputs, rope)
            keys[index].append(k)
            values[index].append(v)
            out = F.scaled_dot_product_attention(q, torch.cat(keys[index], 2), torch.cat(values[index], 2), mask,
                                                 scale=attention.scaling, enable_gqa=True)
            x = layer.finish(residual, attention.o_proj(out.transpose(1, 2).flatten(2)))
        normed = head.norm(x)
        outputs.append(normed)
        hidden = normed if head.config.norm_output else x
    return outputs


def _losses(head: EagleHead, embed, target_head, batch: tuple[Tensor, Tensor, Tensor], steps: int,
            from_position: int = 0) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """Per step: the mean cross-entropy against the target's distribution over the draft
    vocabulary, and whether the head's argmax is the target's [B,n]; and which of those
    positions exist [steps,B,n] (step s at t needs t+1+s < T, and t >= ``from_position``)."""
    tokens, features, last = batch
    B, T = tokens.shape
    n = T - 1
    draft_ids = torch.arange(head.config.draft_vocab_size, device=tokens.device) + head.d2t
    with torch.no_grad():
        target_logits = target_head(last[:, 1:].float())  # position t+1's distribution, t < n
        target_best = target_logits.argmax(-1)
        target_p = F.softmax(target_logits[..., draft_ids], -1)
    losses, agree, exists = [], [], []
    for s, normed in enumerate(unroll(head, embed, tokens, features.float(), steps)):
        t = torch.arange(n, device=tokens.device)
        valid = (t + 1 + s < T) & (t >= from_position)
        m = n - s  # positions with a label at this step
        logits = head.lm_head(normed[:, :m])
        loss = -(target_p[:, s:s + m] * F.log_softmax(logits, -1)).sum(-1)
        losses.append((loss * valid[:m]).sum() / (valid[:m].sum() * B))
        agree.append(F.pad((draft_ids[logits.argmax(-1)] == target_best[:, s:s + m]).int(), (0, s)).bool())
        exists.append(valid.expand(B, -1))
    return losses, agree, torch.stack(exists)


@torch.no_grad()
def agreement(head: EagleHead, embed, target_head, data: tuple[Tensor, Tensor, Tensor], steps: int = 4,
              from_position: int = 0, batch: int = 8) -> dict:
    """The head's agreement with the target's argmax on ``data`` (tokens, features, last), teacher
    forced: ``first`` the first draft's, ``conditional[j]`` draft j+1's given the j before it
    agreed, ``accepted_per_round`` the mean run of agreeing drafts out of ``steps``."""
    runs, count = torch.zeros(steps + 1), 0
    for i in range(0, len(data[0]), batch):
        _, agree, exists = _losses(head, embed, target_head, tuple(x[i:i + batch] for x in data), steps,
                                   from_position)
        ok = exists.all(0)  # positions where every step has a label
        run = torch.stack(agree).int().cumprod(0).sum(0)[ok]
        runs += torch.bincount(run.cpu(), minlength=steps + 1).double()[:steps + 1]
        count += int(ok.sum())
    at_least = runs.flip(0).cumsum(0).flip(0) / max(1, count)  # P(run >= j)
    return dict(first=float(at_least[1]), conditional=[float(at_least[j + 1] / at_least[j].clamp_min(1e-9))
                                                       for j in range(1, steps)],
                accepted_per_round=float(at_least[1:].sum()), positions=count)


def train_head(target, tokenizer, files: list[Path], out: str | Path, work: str | Path,
               settings: HeadTraining | None = None, validation_files: list[Path] | None = None,
               log=print) -> EagleHead:
    """Train an EAGLE-3 head for ``target`` (converted to float32 in place, frozen) on its
    continuations of prompts cut from ``files`` (see the module docstring); save it at
    ``out`` in the speculators layout and return it.
    Everything slow is cached or checkpointed under ``work``: a rerun resumes.
    ``validation_files`` (default: ``files`` with another seed) give the held-out sequences."""
    settings = settings or HeadTraining()
    started = time.perf_counter()
    if not files:
        raise ValueError("data: no training files")
    work, out = Path(work), Path(out)
    work.mkdir(parents=True, exist_ok=True)
    target = frozen_float32(target)
    if settings.sequences < settings.batch:
        raise ValueError(f"batch: {settings.batch} sequences per step, more than the {settings.sequences} sequences")
    layer_ids = tuple(sorted(settings.layer_ids or aux_layer_ids(target)))
    bad = [k for k in layer_ids if not 0 <= k <= num_layers(target)]
    if bad:
        raise ValueError(f"layer_ids: {list(layer_ids)} names layers {bad} the target does not have")
    data = on_policy_splits(target, tokenizer, files, validation_files, layer_ids, work, settings.sequences,
                            settings.validation_sequences, settings.prompt_tokens, settings.new_tokens, settings.seed)
    vocab = target.config.get_text_config().vocab_size
    draft_ids = None
    if settings.draft_vocab is not None and settings.draft_vocab < vocab:
        draft_ids = frequent_tokens(data["train"][0], settings.draft_vocab, vocab)
        covered = torch.isin(data["validation"][0][:, settings.prompt_tokens:], draft_ids).float().mean()
        log(f"draft vocabulary: {settings.draft_vocab} of {vocab} tokens cover {covered:.1%} of the held-out "
            f"continuations")
    head = initial_head(target, tuple(layer_ids), draft_ids, settings.seed)
    embed, target_head = target.get_input_embeddings(), target.get_output_embeddings()
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    checkpoint, step, before = work / "head_checkpoint.pt", 0, 0.0
    history: list[dict] = []
    state = load_checkpoint(checkpoint, asdict(settings))
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step, history, before = state["step"], state["history"], state["seconds"]
        log(f"resumed at step {step}")

    def elapsed() -> float:  # this run's seconds (data included) plus those before a resume
        return before + time.perf_counter() - started

    def validate():
        head.eval()
        result = agreement(head, embed, target_head, data["validation"], 4, settings.prompt_tokens - 1)
        head.train()
        history.append(dict(step=step, seconds=round(elapsed()), **result))
        log(f"step {step}: first-draft agreement {result['first']:.3f}, conditional "
            f"{' / '.join(f'{c:.2f}' for c in result['conditional'])}, accepted per round at k=4 "
            f"{result['accepted_per_round']:.2f} (held-out, teacher forced; {elapsed():.0f} s)")

    if step == 0:
        validate()
    train = data["train"]
    per_epoch = len(train[0]) // settings.batch
    head.train()
    with tqdm(total=settings.steps, initial=step, desc="train head") as bar:
        while step < settings.steps:
            epoch, index = divmod(step, per_epoch)
            order = torch.randperm(len(train[0]), generator=torch.Generator().manual_seed(settings.seed + epoch))
            rows = order[index * settings.batch:(index + 1) * settings.batch]
            losses, agree, exists = _losses(head, embed, target_head, tuple(x[rows] for x in train), settings.ttt)
            loss = sum(settings.decay ** s * l for s, l in enumerate(losses))
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, settings.lr, settings.warmup, settings.steps)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            step += 1
            first = float(agree[0][exists[0]].float().mean())
            bar.set_postfix(loss=f"{losses[0].item():.3f}", agree=f"{first:.3f}")
            bar.update()
            if step % settings.validate_every == 0 or step == settings.steps:
                validate()
            if step % settings.checkpoint_every == 0 or step == settings.steps:
                save_checkpoint(checkpoint, asdict(settings), head=head.state_dict(), optimizer=optimizer.state_dict(),
                                step=step, history=history, seconds=elapsed())
    head.eval()
    head.save(out)
    (out / "training.json").write_text(json.dumps(dict(settings=asdict(settings), history=history), indent=2))
    return head
