"""Predictor training data: teacher-forced features and labels from text the target wrote."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from spec_ext.policies import BranchHint, draft_features, history_features
from spec_ext.policies.learned import HISTORY_FEATURES



@torch.inference_mode()
def features_and_labels(target, draft, sequences: Tensor, start: int, max_length: int = 12,
                        generator: torch.Generator | None = None) -> dict:
    """Teacher-forced predictor data from text the target wrote (its greedy or sampled
    continuations), with the labels of both decoding modes.

    sequences [N,L] int64: prompts of ``start`` tokens and their continuations. For every
    context end i with start-1 <= i <= L-2-max_length (P of them; row-major, so any
    [N*P] entry reshapes to [N,P]):
      * ``specdecpp_x`` [N*P,Hd+3]: :func:`draft_features` at i (where the draft makes q_i);
        ``specdecpp_y_greedy`` [N*P]: 1[argmax q_i == argmax p_i];
        ``specdecpp_y_sampling`` [N*P]: sum_x min(p_i, q_i), the chance a token drawn from
        q_i is accepted. Both hold on any context, so any text serves for both.
      * ``adalength_x`` [N*P,2Ht]: [target embedding of token i+1; target hidden at i]
        (the branch predictor's input; AdaLength's is that and the history);
        ``adalength_history_greedy`` / ``_sampling`` [N*P,2]: :func:`history_features` of
        the drafts accepted in a row up to the one that would have proposed token i+1 (at
        most ``max_length``; greedy: argmax agreements; sampling: one draw of each
        acceptance with ``generator``, default seed 0); ``accepted_greedy`` /
        ``_sampling`` [N*P]: those acceptances (1/0) of the draft made at i;
        ``adalength_y_greedy`` [N*P]: drafts accepted in a round rooted at token i+1 with up
        to ``max_length`` drafts, the run of argmax agreements from i+1 (exact on greedy
        continuations, where accepted drafts are the text's own tokens);
        ``adalength_y_sampling`` [N*P]: the expected count sum_j prod_{m<=j} sum_x min(p_m, q_m)
        (acceptances taken as independent).
      * ``sequence`` [N*P] int64: the row of ``sequences`` each entry comes from.
    """
    L = sequences.shape[1]
    if L - 1 - max_length <= start - 1:
        raise ValueError(f"sequences: need more than start + max_length = {start + max_length} tokens, got {L}")
    t_out = target(input_ids=sequences, output_hidden_states=True)
    d_out = draft(input_ids=sequences, output_hidden_states=True)
    p, q = torch.softmax(t_out.logits.float(), -1), torch.softmax(d_out.logits.float(), -1)
    ends = torch.arange(start - 1, L - 1 - max_length)
    out = dict(sequence=torch.arange(len(sequences)).repeat_interleave(len(ends)))
    accept = dict(greedy=(p.argmax(-1) == q.argmax(-1)).float(), sampling=torch.minimum(p, q).sum(-1))  # [N,L]
    generator = generator or torch.Generator().manual_seed(0)
    drawn = dict(greedy=accept["greedy"],
                 sampling=(torch.rand(accept["sampling"].shape, generator=generator) < accept["sampling"]).float())
    for mode, a in accept.items():
        out[f"specdecpp_y_{mode}"] = a[:, ends].reshape(-1)
        out[f"adalength_y_{mode}"] = accepted_runs(a, max_length)[:, ends + 1].reshape(-1)
        before = accepted_runs(drawn[mode].flip(1), max_length).flip(1)  # accepted in a row, ending at each i
        out[f"adalength_history_{mode}"] = history_features(before[:, ends]).reshape(-1, HISTORY_FEATURES)
        out[f"accepted_{mode}"] = drawn[mode][:, ends].reshape(-1)
    hidden = d_out.hidden_states[-1][:, ends]
    out["specdecpp_x"] = draft_features(hidden.reshape(-1, hidden.shape[-1]), q[:, ends].reshape(-1, q.shape[-1]))
    embed = target.get_input_embeddings()(sequences[:, ends + 1]).float()
    out["adalength_x"] = torch.cat([embed, t_out.hidden_states[-1][:, ends].float()], -1).reshape(
        -1, 2 * target.config.hidden_size)
    return out


def accepted_runs(accept: Tensor, max_length: int) -> Tensor:
    """accept [N,L] float (1/0, or acceptance chances) -> [N,L]: at j, the drafts a round
    of up to ``max_length`` accepts from j on, sum_{m<max_length} prod_{i<=m} accept[:, j+i]
    (the expected count for chances taken as independent; past the end counts as rejected)."""
    windows = torch.nn.functional.pad(accept, (0, max_length)).unfold(1, max_length, 1)[:, :accept.shape[1]]
    return windows.cumprod(-1).sum(-1)


def branch_classes(lengths: Tensor, accept_all_length: int = 4) -> Tensor:
    """Branch-point labels (:class:`BranchHint` values) from accepted lengths: REJECT_ALL
    when none was accepted, ACCEPT_ALL from ``accept_all_length`` on, else DEFER."""
    classes = torch.full_like(lengths, int(BranchHint.DEFER), dtype=torch.int64)
    classes[lengths < 0.5] = int(BranchHint.REJECT_ALL)
    classes[lengths >= accept_all_length] = int(BranchHint.ACCEPT_ALL)
    return classes


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


def dataset(target, draft, sequences, start, max_length, batch=32) -> dict:
    """:func:`features_and_labels` of ``sequences`` in batches, plus AdaLength's inputs per mode."""
    generator = torch.Generator().manual_seed(0)
    parts = [features_and_labels(target, draft, sequences[i:i + batch], start, max_length, generator)
             for i in range(0, len(sequences), batch)]
    data = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "sequence"}
    for mode in ("greedy", "sampling"):  # AdaLength's input in each mode
        data[f"adalength_in_{mode}"] = torch.cat([data["adalength_x"], data[f"adalength_history_{mode}"]], -1)
    data["sequence"] = torch.cat([p["sequence"] + i for i, p in zip(range(0, len(sequences), batch), parts)])
    data["positions"] = len(data["sequence"]) // len(sequences)
    return data


def by_sequence(data: dict, x: str, y: str, held: Tensor) -> tuple[tuple, tuple]:
    """(train, held-out) pairs of ``data[x], data[y]``; held [N] bool marks held-out sequences."""
    mask = held[data["sequence"]]
    return (data[x][~mask], data[y][~mask]), (data[x][mask], data[y][mask])
