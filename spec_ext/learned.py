"""Learned draft-length policies and the functions that train them on any pair.

* :class:`SpecDecPP` (SpecDec++): a residual MLP on the draft's last hidden state predicts
  the probability that the token drafted from it is accepted; drafting stops once the
  predicted probability that some draft of the round is rejected, 1 - prod(accept),
  exceeds ``threshold``. The head reads the hidden state that produced the draft token's
  distribution, so deciding costs no extra draft forward.
* :class:`AdaLength` (AdaEAGLE's length predictor): a residual MLP on [target input
  embedding of the round's root token; target last hidden state that produced it]
  predicts how many drafts the target will accept; the round drafts that many.
* :class:`BranchPredictor` (SpecBranch's branch points): a 3-class residual MLP on the same
  features says whether the next drafts are likely all rejected (branch at once), all
  accepted (no branches) or uncertain (branch by the draft's confidence);
  :class:`LearnedSpecBranch` is SpecBranch driven by it.

Each predictor has two outputs, one per decoding mode: greedy (trained on the target's
greedy continuations with exact greedy labels) and sampling (trained on its temperature-1
samples with soft labels sum_x min(p, q) = E_{x~q} min(1, p(x)/q(x))). The policies only
choose lengths, so outputs stay exact whatever the predictors say.

Predictors are safetensors files with their config in the metadata;
``benchmarks/train_policies.py`` makes ``models/policies/*.safetensors`` for the bundled
pair, and ``policy="specdecpp"`` / ``"adalength"`` / ``"learnedspecbranch"`` load those.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_ext.parallel import SpecBranch
from spec_ext.policies import Policy, register

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "models" / "policies"
GREEDY, SAMPLING = 0, 1  # output columns of every predictor


class ResidualMLP(nn.Module):
    """in_features -> hidden, ``depth`` pre-norm residual blocks, -> out_features."""

    def __init__(self, in_features: int, out_features: int = 2, hidden: int = 256, depth: int = 2):
        super().__init__()
        self.config = dict(in_features=in_features, out_features=out_features, hidden=hidden, depth=depth)
        self.inp = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
            for _ in range(depth))
        self.out = nn.Linear(hidden, out_features)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)

    def save(self, path: str | Path, **settings) -> None:
        """Weights plus config and policy ``settings`` (JSON in the safetensors metadata)."""
        from safetensors.torch import save_file
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path), metadata={"config": json.dumps(self.config), "settings": json.dumps(settings)})

    @classmethod
    def load(cls, path: str | Path) -> tuple["ResidualMLP", dict]:
        from safetensors import safe_open
        from safetensors.torch import load_file
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if "config" not in meta:
            raise ValueError(f"predictor: {path} has no spec_ext predictor config in its metadata")
        model = cls(**json.loads(meta["config"]))
        model.load_state_dict(load_file(str(path)))
        return model.eval(), json.loads(meta.get("settings", "{}"))


def _predictor(source, name: str) -> tuple[ResidualMLP, dict]:
    if isinstance(source, ResidualMLP):
        return source.eval(), {}
    path = Path(source) if source is not None else DEFAULT_DIR / f"{name}.safetensors"
    if not path.exists():
        raise ValueError(f"predictor: {path} not found; train one with benchmarks/train_policies.py or pass "
                         f"predictor=<path to a .safetensors file | ResidualMLP>")
    model, settings = ResidualMLP.load(path)
    if settings.get("kind", name) != name:
        raise ValueError(f"predictor: {path} holds a {settings['kind']!r} predictor, not {name!r}")
    return model, settings


def _check_width(predictor: ResidualMLP, expected: int, what: str, policy: str) -> None:
    if predictor.config["in_features"] != expected:
        raise ValueError(f"predictor: the {policy} predictor takes {predictor.config['in_features']} features but "
                         f"{what} gives {expected}; train one for this pair (benchmarks/train_policies.py)")


@register
class SpecDecPP(Policy):
    """SpecDec++: stop drafting once 1 - prod(predicted acceptance) > ``threshold``.

    Args:
        predictor: path of a safetensors predictor, a :class:`ResidualMLP` or None for
            the bundled pair's (``models/policies/specdecpp.safetensors``).
        threshold, max_draft: None takes the values tuned with the predictor.
    """

    needs = ("draft_hidden",)

    def __init__(self, predictor=None, threshold: float | None = None, max_draft: int | None = None):
        self._predictor, settings = _predictor(predictor, "specdecpp")
        self.threshold = settings.get("threshold", 0.5) if threshold is None else threshold
        self.max_draft = settings.get("max_draft", 12) if max_draft is None else max_draft
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold: must be in (0, 1), got {self.threshold}")
        if self.max_draft < 1:
            raise ValueError(f"max_draft: must be >= 1, got {self.max_draft}")

    def bind(self, target, draft) -> None:
        _check_width(self._predictor, draft.config.hidden_size, "the draft's hidden state", "SpecDecPP")
        self._predictor.to(draft.device)

    def keep_drafting(self, step, probs, tokens, hidden=None) -> Tensor:
        column = GREEDY if self.greedy else SAMPLING
        accept = torch.sigmoid(self._predictor(hidden.float())[:, column])
        self._all_accepted = accept if step == 1 else self._all_accepted * accept
        return 1 - self._all_accepted <= self.threshold


@register
class AdaLength(Policy):
    """AdaEAGLE's lightweight draft-length predictor: each round drafts
    ceil(predicted accepted length + ``offset``) tokens, between 1 and ``max_draft``.

    Args:
        predictor: path of a safetensors predictor, a :class:`ResidualMLP` or None for
            the bundled pair's (``models/policies/adalength.safetensors``).
        offset, max_draft: None takes the values tuned with the predictor.
    """

    needs = ("target_hidden",)

    def __init__(self, predictor=None, offset: float | None = None, max_draft: int | None = None):
        self._predictor, settings = _predictor(predictor, "adalength")
        self.offset = settings.get("offset", 0.0) if offset is None else offset
        self.max_draft = settings.get("max_draft", 12) if max_draft is None else max_draft
        self._first = settings.get("first_round", 3)
        if self.max_draft < 1:
            raise ValueError(f"max_draft: must be >= 1, got {self.max_draft}")

    def bind(self, target, draft) -> None:
        _check_width(self._predictor, 2 * target.config.hidden_size,
                     "[target input embedding; target hidden state]", "AdaLength")
        self._embed = target.get_input_embeddings()
        self._predictor.to(target.device)

    def start(self, batch_size, greedy=True) -> None:
        super().start(batch_size, greedy)
        self._k = [min(self._first, self.max_draft)] * batch_size

    def see_target(self, hidden: Tensor, next_tokens: Tensor) -> None:
        features = torch.cat([self._embed(next_tokens).float(), hidden.float()], -1)
        length = self._predictor(features)[:, GREEDY if self.greedy else SAMPLING] + self.offset
        self._k = length.ceil().clamp(1, self.max_draft).long().tolist()

    def plan(self) -> list[int]:
        return list(self._k)

    def keep_rows(self, rows) -> None:
        super().keep_rows(rows)
        self._k = [self._k[r] for r in rows]


class BranchPredictor:
    """SpecBranch's branch-point predictor: a 3-class residual MLP on [target input
    embedding of a row's new root; target hidden state that produced it] -> REJECT_ALL
    (the next draft is likely rejected: branch at once), DEFER (branch by the draft's
    confidence) or ACCEPT_ALL (the next ``accept_all_length`` drafts likely all pass:
    draft a plain chain). Six outputs: three for greedy decoding, three for sampling.

    Example:
        >>> policy = SpecBranch(predictor=BranchPredictor())   # the bundled pair's  # doctest: +SKIP
    """

    def __init__(self, predictor=None):
        self._model, settings = _predictor(predictor, "branch")
        self.accept_all_length = settings.get("accept_all_length", 4)
        if self._model.config["out_features"] != 6:
            raise ValueError(f"predictor: a branch predictor has 6 outputs, got {self._model.config['out_features']}")

    def bind(self, target) -> None:
        _check_width(self._model, 2 * target.config.hidden_size,
                     "[target input embedding; target hidden state]", "branch")
        self._embed = target.get_input_embeddings()
        self._model.to(target.device)

    def classify(self, hidden: Tensor, roots: Tensor, greedy: bool) -> list[int]:
        features = torch.cat([self._embed(roots).float(), hidden.float()], -1)
        logits = self._model(features)[:, :3] if greedy else self._model(features)[:, 3:]
        return logits.argmax(-1).tolist()


def branch_classes(lengths: Tensor, accept_all_length: int = 4) -> Tensor:
    """Branch-point labels from accepted lengths: 0 (none accepted: REJECT_ALL),
    2 (at least ``accept_all_length``: ACCEPT_ALL), else 1 (DEFER)."""
    classes = torch.ones_like(lengths, dtype=torch.int64)
    classes[lengths < 0.5] = 0
    classes[lengths >= accept_all_length] = 2
    return classes


@register
class LearnedSpecBranch(SpecBranch):
    """:class:`spec_ext.parallel.SpecBranch` with the bundled pair's branch-point
    predictor (``models/policies/branch.safetensors``) or ``predictor`` (a path, a
    :class:`ResidualMLP` or a :class:`BranchPredictor`)."""

    def __init__(self, branches: int = 4, gamma: int | None = None, mode: str = "threads", draft_rank: int = 1,
                 timeout: float = 60.0, max_gamma: int = 12, predictor=None):
        if not isinstance(predictor, BranchPredictor):
            predictor = BranchPredictor(predictor)
        super().__init__(branches, gamma, mode, draft_rank, timeout, max_gamma, predictor)


# ---------------------------------------------------------------------- training
@torch.inference_mode()
def features_and_labels(target, draft, sequences: Tensor, start: int, greedy: bool, max_length: int = 12) -> dict:
    """Teacher-forced predictor data from the target's own continuations.

    sequences [N,L] int64: prompts of ``start`` tokens continued by the target (greedily
    when ``greedy``, else sampled at temperature 1). For every context end i with
    start-1 <= i <= L-2-max_length:
      * ``specdecpp_x`` [M,Hd]: the draft's hidden state at i (it produces q_i);
        ``specdecpp_y`` [M]: greedy 1[argmax q_i == argmax p_i], sampling sum_x min(p_i, q_i);
      * ``adalength_x`` [M,2Ht]: [target embedding of token i+1; target hidden at i];
        ``adalength_y`` [M]: drafts accepted in a round rooted at token i+1 with up to
        ``max_length`` drafts: greedy, the run of draft/target argmax agreements from i+1
        (exact, since accepted drafts equal the target's own tokens); sampling, the
        expected count sum_j prod_{m<=j} sum_x min(p_m, q_m).
    """
    t_out = target(input_ids=sequences, output_hidden_states=True)
    d_out = draft(input_ids=sequences, output_hidden_states=True)
    p, q = torch.softmax(t_out.logits.float(), -1), torch.softmax(d_out.logits.float(), -1)
    if greedy:
        accept = (p.argmax(-1) == q.argmax(-1)).float()  # [N,L]
    else:
        accept = torch.minimum(p, q).sum(-1)
    L = sequences.shape[1]
    if L - 1 - max_length <= start - 1:
        raise ValueError(f"sequences: need more than start + max_length = {start + max_length} tokens, got {L}")
    ends = torch.arange(start - 1, L - 1 - max_length)
    windows = accept.unfold(1, max_length, 1)[:, ends + 1]  # [N,M,max_length]: accept at i+1 .. i+max_length
    lengths = windows.cumprod(-1).sum(-1)  # sampling: the expected count if acceptances were independent
    embed = target.get_input_embeddings()(sequences[:, ends + 1]).float()
    return dict(
        specdecpp_x=d_out.hidden_states[-1][:, ends].float().reshape(-1, draft.config.hidden_size),
        specdecpp_y=accept[:, ends].reshape(-1),
        adalength_x=torch.cat([embed, t_out.hidden_states[-1][:, ends].float()], -1).reshape(
            -1, 2 * target.config.hidden_size),
        adalength_y=lengths.reshape(-1),
    )


def asymmetric_l1(prediction: Tensor, target: Tensor, under_weight: float = 2.0) -> Tensor:
    """L1 loss with under-prediction (prediction < target) weighted ``under_weight``."""
    error = target - prediction
    return torch.where(error > 0, under_weight * error, -error).mean()


def train_predictor(model: ResidualMLP, data: dict[int, tuple[Tensor, Tensor]], loss: str, epochs: int = 8,
                    batch: int = 512, lr: float = 2e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Train ``model``'s output columns on ``data[column] = (x [M,F], y [M])``.

    loss: "bce" (acceptance probabilities, soft labels allowed), "asymmetric_l1"
    (lengths) or "cross_entropy" (class labels y; column c is output group c*3..c*3+2).
    Returns the mean training loss of every epoch.
    """
    from tqdm import tqdm
    if loss not in ("bce", "asymmetric_l1", "cross_entropy"):
        raise ValueError(f"loss: expected 'bce', 'asymmetric_l1' or 'cross_entropy', got {loss!r}")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps_per_epoch = max(math.ceil(len(y) / batch) for _, y in data.values())
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=epochs * steps_per_epoch)
    history = []
    model.train()
    for _ in tqdm(range(epochs), desc=f"train {loss}", disable=not progress):
        orders = {c: torch.randperm(len(y), generator=generator) for c, (_, y) in data.items()}
        total = 0.0
        for step in range(steps_per_epoch):
            value = 0.0
            for column, (x, y) in data.items():
                index = orders[column][(step * batch) % len(y):][:batch]
                if loss == "cross_entropy":
                    out = model(x[index])[:, 3 * column:3 * column + 3]
                    value = value + F.cross_entropy(out, y[index].long())
                    continue
                out = model(x[index])[:, column]
                if loss == "bce":
                    value = value + F.binary_cross_entropy_with_logits(out, y[index])
                else:
                    value = value + asymmetric_l1(out, y[index])
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            optimizer.step()
            schedule.step()
            total += value.item()
        history.append(total / steps_per_epoch)
    model.eval()
    return history
