"""What every drafter that reads the target's hidden states shares (the EAGLE head, the DFlash
block drafter, an MTP drafter).

A feature drafter names the target layers it reads in ``Drafter.target_layers`` (HF's
``hidden_states[k]``: the input of decoder layer k, k = L the output of the final norm). The
engine then hands it, concatenated in that order, the features of each prompt's tokens but
its last in ``Drafter.start`` and the features of every verified position in
``Outcome.features``; nothing else runs the target for it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from spec_ext.models import num_layers

__all__ = ["bind_layers", "check_draft_vocabulary", "committed_features", "join_columns", "prompt_features"]


def bind_layers(target, layer_ids, width: int | None, layers_field: str, width_field: str) -> tuple[int, ...]:
    """The target layers ``layer_ids`` (ints in 0..L) a drafter reads, checked against
    ``target``; ``width``: the hidden size the drafter expects of each (None: not checked).
    Raises ``ValueError`` naming ``layers_field`` / ``width_field``."""
    L = num_layers(target)
    ids = tuple(int(k) for k in layer_ids)
    bad = [k for k in ids if not 0 <= k <= L]
    if bad:
        raise ValueError(f"{layers_field}: {list(ids)} names layers {bad} the target (of {L} layers, hidden "
                         f"states 0..{L}) does not have")
    hidden = target.config.get_text_config().hidden_size
    if width is not None and width != hidden:
        raise ValueError(f"{width_field}: the drafter reads features of width {width}, the target's hidden size "
                         f"is {hidden}")
    return ids


def check_draft_vocabulary(d2t: Tensor | None, vocab_size: int, field: str = "d2t") -> None:
    """Raise ``ValueError`` unless every draft id ``i + d2t[i]`` is a token of the target's
    vocabulary of ``vocab_size`` (None: the drafter drafts over the target's own)."""
    if d2t is None:
        return
    drafted = torch.arange(len(d2t)) + d2t.cpu()
    if int(drafted.max()) >= vocab_size or int(drafted.min()) < 0:
        raise ValueError(f"{field}: the drafter drafts token ids outside the target's {vocab_size} "
                         f"(ids {int(drafted.min())}..{int(drafted.max())})")


def prompt_features(features: Tensor | None, batch_size: int, width: int, dtype: torch.dtype, device) -> Tensor:
    """``start``'s ``features`` [B,L,F] as given, or [B,0,width] where every prompt has one token."""
    if features is None:
        return torch.zeros(batch_size, 0, width, dtype=dtype, device=device)
    return features.to(device=device, dtype=dtype)


def committed_features(outcome) -> tuple[Tensor, Tensor, list[int], Tensor]:
    """What the target committed of the last round, for every row: the features [B,W,F] of
    the verified positions it kept (the root and the accepted drafts: a chain's first
    ``accepted + 1`` positions, a tree's path), the tokens [B,W] each of those positions
    predicted (the accepted drafts then the final token; -1 padding clamped to 0), and each
    row's count W_b = accepted + 1 on the host and the device. Position j of row b is the
    committed sequence's position n_b + j (n_b the round's root)."""
    B = len(outcome.accepted)
    width = max(outcome.accepted) + 1
    device = outcome.features.device
    steps = torch.arange(width, device=device)
    positions = steps.expand(B, -1) if outcome.path is None else outcome.path[:, :width].clamp_min(0)
    features = outcome.features.gather(1, positions[..., None].expand(-1, -1, outcome.features.shape[-1]))
    tokens = outcome.tokens[:, :width].clamp_min(0)
    return features, tokens, [a + 1 for a in outcome.accepted], outcome.num_accepted + 1


def join_columns(parts: list[tuple[tuple[Tensor, ...], list[int], list[int]]]) -> tuple[tuple[Tensor, ...], list[int]]:
    """Per row, runs of columns of several parts joined in order, left-aligned. A part is
    (tensors [B,W_i,...] of one width W_i, each row's first column, each row's count); the
    tensors of every part line up (ids with their features) and take the first part's dtypes.
    Returns the joined tensors [B,max(total),...] and each row's total; a row's columns past
    its total repeat its last one (never read). Example: parts ((x,), [1, 0], [2, 1]) and
    ((y,), [0, 0], [1, 2]) give rows [x01, x02, y00] and [x10, y10, y11]."""
    B = len(parts[0][1])
    totals = [sum(counts[b] for _, _, counts in parts) for b in range(B)]
    width, offset, index = max(totals), 0, [[] for _ in range(B)]
    for tensors, firsts, counts in parts:
        for b in range(B):
            index[b] += range(offset + firsts[b], offset + firsts[b] + counts[b])
        offset += tensors[0].shape[1]
    index = torch.tensor([row + (row[-1:] or [0]) * (width - len(row)) for row in index], dtype=torch.int64,
                         device=parts[0][0][0].device)
    joined = []
    for i, first in enumerate(parts[0][0]):
        columns = torch.cat([first] + [tensors[i].to(first.dtype) for tensors, _, _ in parts[1:]], 1)
        at = index.view(B, width, *[1] * (columns.dim() - 2)).expand(-1, -1, *columns.shape[2:])
        joined.append(columns.gather(1, at))
    return tuple(joined), totals
