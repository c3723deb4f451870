"""What every drafter recipe trains on: the target's own continuations of prompts cut from text
files, the target's hidden states of them (cached), and the checkpoint plumbing that lets a
killed run resume. Used by :mod:`spec_ext.training.head` (EAGLE-3 heads) and
:mod:`spec_ext.training.dflash` (block drafters); imports neither.
"""
from __future__ import annotations

import hashlib
import math
import os
import random
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm


def prompts_from_files(tokenizer, files: list[Path], count: int, prompt_tokens: int, seed: int = 0,
                       min_chars: int = 4000) -> list[list[int]]:
    """``count`` prompts of ``prompt_tokens`` tokens, each ending at a line break of one of
    ``files`` (those of at least ``min_chars`` characters), chosen deterministically by ``seed``."""
    rng = random.Random(seed)
    texts = [t for t in (Path(f).read_text(encoding="utf-8", errors="replace") for f in files) if len(t) > min_chars]
    if not texts:
        raise ValueError(f"data: no file of more than {min_chars} characters among {len(files)}")
    prompts = []
    for _ in range(100 * count):
        if len(prompts) == count:
            break
        text = rng.choice(texts)
        cut = text.rfind("\n", 0, rng.randrange(min_chars // 2, len(text) - min_chars // 4)) + 1
        ids = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_tokens:
            prompts.append(ids[-prompt_tokens:])
    if len(prompts) < count:
        raise ValueError(f"prompt_tokens: {prompt_tokens} tokens before a line break are rare in these files "
                         f"({len(prompts)} of {count} prompts in {100 * count} cuts); use shorter prompts or longer "
                         f"files")
    return prompts


def continuations(target, prompts, new_tokens, greedy, batch, path: Path) -> torch.Tensor:
    """[N, L] the target's greedy (or T=1) continuations of ``prompts``, cached at ``path``."""
    if path.exists():
        return torch.load(path)
    chunks = []
    torch.manual_seed(0)
    for i in tqdm(range(0, len(prompts), batch), desc=f"generate {'greedy' if greedy else 'T=1'}"):
        ids = torch.tensor(prompts[i:i + batch])
        sample = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=None, top_p=None)
        with torch.inference_mode():
            chunks.append(target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                          pad_token_id=0, **sample))
    sequences = torch.cat(chunks)
    torch.save(sequences, path)
    return sequences


@torch.inference_mode()
def tap_features(target, sequences: Tensor, layer_ids: tuple[int, ...], path: Path | None, batch: int = 16
                 ) -> tuple[Tensor, Tensor]:
    """The target's hidden states of ``layer_ids`` concatenated [N,T,A*H] and its last hidden
    state [N,T,H] (HF's ``hidden_states[L]``, after the final norm) of ``sequences`` [N,T],
    bfloat16, cached at ``path`` (None: not cached)."""
    from safetensors.torch import load_file, save_file
    if path is not None and path.exists():
        data = load_file(str(path))
        return data["features"], data["last"]
    if len(sequences) == 0:
        raise ValueError("sequences: no sequence to tap the features of")
    # written in place: a list of chunks joined at the end held them twice (16384 continuations of the bundled
    # target: 11.7 GB each way, killed on a 24 GB machine)
    features = last = None
    for i in tqdm(range(0, len(sequences), batch), desc="tap features"):
        states = target(sequences[i:i + batch].to(target.device), output_hidden_states=True).hidden_states
        chunk = torch.cat([states[k] for k in layer_ids], -1)
        if features is None:
            features = torch.empty(len(sequences), *chunk.shape[1:], dtype=torch.bfloat16)
            last = torch.empty(len(sequences), *states[-1].shape[1:], dtype=torch.bfloat16)
        features[i:i + batch] = chunk
        last[i:i + batch] = states[-1]
    if path is not None:
        save_file({"features": features, "last": last}, str(path))
    return features, last


def frequent_tokens(sequences: Tensor, size: int, vocab: int) -> Tensor:
    """The ``size`` most frequent token ids of ``sequences``, ascending (ties: lower id first)."""
    counts = torch.bincount(sequences.flatten(), minlength=vocab)
    return torch.sort(-counts, stable=True).indices[:size].sort().values


def fingerprint(target, files: list[Path], *numbers: int) -> str:
    """A short hash of the target's config, the files (paths, sizes, times) and ``numbers``."""
    digest = hashlib.sha256(target.config.to_json_string(use_diff=False).encode())
    for f in files:
        stat = Path(f).stat()
        digest.update(f"{f}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    digest.update(repr(numbers).encode())
    return digest.hexdigest()[:12]


def frozen_float32(target):
    """``target`` converted to float32 in place, in eval mode, with no parameter requiring a gradient."""
    target = target.float().eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    return target


def on_policy_splits(target, tokenizer, files: list[Path], validation_files: list[Path] | None, layer_ids,
                     work: Path, sequences: int, validation_sequences: int, prompt_tokens: int, new_tokens: int,
                     seed: int, generate_batch: int = 64) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """``{"train": ..., "validation": ...}``, each (sequences [N,P+C] int64, features [N,P+C,A*H]
    bf16 of ``layer_ids``, last hidden state [N,P+C,H] bf16): the target's greedy continuations
    (C = ``new_tokens``) of prompts (P = ``prompt_tokens``) cut from ``files`` (validation: from
    ``validation_files``, default ``files``, with seed ``seed + 1``), with their features.
    Cached under ``work`` by names that change with anything that changes them (target, files,
    seed, sizes, layers), so a rerun reuses them and other data never do. ``generate_batch``:
    prompts continued per ``generate`` call."""
    data = {}
    for split, count, split_seed, source in (("train", sequences, seed, files),
                                             ("validation", validation_sequences, seed + 1,
                                              validation_files or files)):
        key = fingerprint(target, source, split_seed, count, prompt_tokens, new_tokens)
        prompts = prompts_from_files(tokenizer, source, count, prompt_tokens, split_seed)
        tokens = continuations(target, prompts, new_tokens, True, generate_batch, work / f"{split}_{key}.pt")
        features, last = tap_features(target, tokens, tuple(layer_ids),
                                      work / f"{split}_{key}_features_{'-'.join(map(str, layer_ids))}.safetensors")
        data[split] = (tokens, features, last)
    return data


def cosine_lr(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warm-up over ``warmup`` steps to ``lr``, then a cosine down to a tenth of it at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(path: Path, settings: dict, **state) -> None:
    """``state`` and ``settings`` saved at ``path`` through a temporary file renamed over it, so a run
    killed while saving leaves the previous checkpoint whole."""
    partial = path.with_name(path.name + ".partial")
    torch.save(dict(state, settings=settings), partial)
    os.replace(partial, path)


def load_checkpoint(path: Path, settings: dict) -> dict | None:
    """The state :func:`save_checkpoint` saved at ``path`` (None when there is none); a checkpoint
    made with other ``settings`` is refused."""
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    if state["settings"] != settings:
        changed = sorted(k for k in set(settings) | set(state["settings"])
                         if settings.get(k) != state["settings"].get(k))
        raise ValueError(f"work: {path} was made with other settings ({', '.join(changed)}); remove it or use "
                         f"another --work")
    return state
