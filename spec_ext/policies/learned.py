"""Learned policies: predictors that choose draft lengths and branch points.

* :class:`SpecDecPP` (SpecDec++): a residual MLP on the draft's last hidden state (a feature
  head's: what its output layer reads) plus three numbers of the distribution q it produced
  (log max q, entropy, top-1 minus top-2, see :func:`draft_features`) predicts the
  probability that the token drafted from q is accepted; drafting stops once the predicted
  probability that some draft of the round is rejected, 1 - prod(accept), exceeds
  ``threshold``. Deciding costs no extra draft forward; on CPU in float32 each draft step's
  decision is one call of the fused kernel :func:`spec_ext.ops.acceptance_head`.
* :class:`AdaLength` (AdaEAGLE's length predictor): a residual MLP on [target input
  embedding of the round's root token; target last hidden state that produced it; the
  row's recent history (:func:`history_features`)] predicts how many drafts the target
  will accept; the round drafts that many.
* :class:`BranchPredictor` (SpecBranch's branch points): a 3-class residual MLP on the same
  features says whether the next drafts are likely all rejected (branch at once), all
  accepted (no branches) or uncertain (branch by the draft's confidence);
  :class:`LearnedSpecBranch` is SpecBranch driven by it.

Each predictor has two outputs, one per decoding mode: greedy (exact greedy labels) and
sampling (soft labels sum_x min(p, q) = E_{x~q} min(1, p(x)/q(x))), each with its own
threshold or offset, tuned at batch 1 and for batches (where a draft step costs more next
to a verification, so shorter drafts pay). The policies only choose lengths, so outputs
stay exact whatever the predictors say.

Predictors are safetensors files with their config in the metadata;
:mod:`spec_ext.training` makes them for any pair (``benchmarks/train_policies.py``), and
``policy="specdecpp"`` / ``"adalength"`` / ``"learnedspecbranch"`` load the bundled pair's
(``policies/*.safetensors`` of :mod:`spec_ext.bundled`).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_ext import ops
from spec_ext.bundled import bundled_path
from spec_ext.models.eagle import EagleHead
from spec_ext.policies.base import Policy, register
from spec_ext.policies.parallel import BranchHint, SpecBranch

GREEDY, SAMPLING = 0, 1  # output columns of every predictor
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which ResidualMLP keeps


class ResidualMLP(nn.Module):
    """in_features -> hidden, ``depth`` pre-norm residual blocks, -> out_features."""

    def __init__(self, in_features: int, out_features: int = 2, hidden: int = 256, depth: int = 2):
        super().__init__()
        self.config = dict(in_features=in_features, out_features=out_features, hidden=hidden, depth=depth)
        self.inp = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden, eps=LAYER_NORM_EPS), nn.Linear(hidden, hidden), nn.SiLU(),
                          nn.Linear(hidden, hidden))
            for _ in range(depth))
        self.out = nn.Linear(hidden, out_features)

    def forward(self, x: Tensor) -> Tensor:
        # functional calls: a policy runs this once per draft step at batch 1, where calling
        # each submodule costs more than its arithmetic (18 instead of 56 us per call)
        h = F.linear(x, self.inp.weight, self.inp.bias)
        for norm, up, _, down in self.blocks:
            y = F.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            h = h + F.linear(F.silu(F.linear(y, up.weight, up.bias)), down.weight, down.bias)
        return F.linear(h, self.out.weight, self.out.bias)

    def weights(self) -> list[Tensor]:
        """The parameters in :func:`spec_ext.ops.acceptance_head`'s order."""
        blocks = [t for norm, up, _, down in self.blocks
                  for t in (norm.weight, norm.bias, up.weight, up.bias, down.weight, down.bias)]
        return [t.detach() for t in (self.inp.weight, self.inp.bias, *blocks, self.out.weight, self.out.bias)]

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


def input_embedding(target):
    """``target``'s input embedding as a function of token ids that runs on this rank alone
    (a tensor-parallel target's table is gathered once: its own module would need every rank)."""
    weight = target.get_input_embeddings().weight
    if hasattr(weight, "full_tensor"):  # a DTensor shard
        weight = weight.full_tensor()
    return functools.partial(F.embedding, weight=weight)


def _predictor(source, name: str) -> tuple[ResidualMLP, dict]:
    if isinstance(source, ResidualMLP):
        return source.eval(), {}
    if source is None:
        try:
            path = bundled_path("policies", f"{name}.safetensors")
        except FileNotFoundError as error:
            raise ValueError(f"predictor: {error}, or pass predictor=<path to a .safetensors file | "
                             f"ResidualMLP> (benchmarks/train_policies.py trains one)") from None
    else:
        path = Path(source)
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


def draft_features(hidden: Tensor, probs: Tensor) -> Tensor:
    """SpecDecPP's input [B,H+3] float32: the draft's hidden state [B,H] that produced the
    distribution ``probs`` [B,V] (temperature 1), then log max q, entropy of q and
    max q minus the second largest q. The three numbers carry most of what generalises to
    unseen text; the hidden state alone over-fits the training sequences."""
    probs = probs.float()
    top = probs.topk(2, dim=-1).values
    return torch.cat([hidden.float(), top[:, :1].log(), torch.special.entr(probs).sum(-1, keepdim=True),
                      top[:, :1] - top[:, 1:]], -1)


DRAFT_EXTRA_FEATURES = 3  # the numbers draft_features appends to the hidden state


def history_features(accepted_before: Tensor) -> Tensor:
    """AdaLength's history input [..., 2] float32 from ``accepted_before`` [...]: for how
    many positions in a row just before the round's root the draft agreed with the target
    (0 after a rejected draft; over consecutive rounds that accepted every draft and whose
    draft also agreed with the bonus token, each counting its drafts + 1; at most the
    longest draft), as that count / 4 and whether it is > 0. Acceptance comes in bursts:
    on the validation split the run after a round that accepted all 12 drafts averages 8.7,
    after a rejection 1.9; with these two numbers the replayed AdaLength went from 1.01x to
    1.03x the best fixed k (greedy)."""
    return torch.stack([accepted_before.float() / 4, (accepted_before > 0).float()], -1)


HISTORY_FEATURES = 2  # the numbers history_features gives per row


def _per_mode(value, settings: dict, key: str, default: float) -> dict[tuple[bool, bool], float]:
    """{(greedy, batched): setting}: ``value`` everywhere when given, else as tuned (batched:
    tuned for batches, used at batch > 1; the batch-1 value where none was tuned)."""
    if value is not None:
        return {(g, b): float(value) for g in (True, False) for b in (False, True)}
    greedy = settings.get(key, default)
    sampling = settings.get(f"{key}_sampling", greedy)
    return {(True, False): greedy, (False, False): sampling,
            (True, True): settings.get(f"{key}_batch", greedy),
            (False, True): settings.get(f"{key}_batch_sampling", sampling)}


@register
class SpecDecPP(Policy):
    """SpecDec++: stop drafting once 1 - prod(predicted acceptance) > ``threshold``.

    A batch drafts as one: the batch goes on while 1 - mean over rows of prod(predicted
    acceptance) <= ``threshold`` (at batch 1, the rule above). Stopping a row alone would
    save nothing, as the batch pays each draft forward whether one row goes on or all, and
    the target verifies every row to the longest draft; going on while any row is confident
    drafts near ``max_draft`` for all (batch 8: 9 drafts per round instead of 5, 0.8x).

    Args:
        predictor: path of a safetensors predictor, a :class:`ResidualMLP` or None for
            the bundled pair's (``policies/specdecpp.safetensors``).
        threshold: one value for every case, or None for the values tuned with the
            predictor (for greedy and for sampling, at batch 1 and for batches).
        max_draft: None takes the value tuned with the predictor.
    """

    uses_draft_hidden = True

    def __init__(self, predictor=None, threshold: float | None = None, max_draft: int | None = None):
        self._predictor, settings = _predictor(predictor, "specdecpp")
        self.thresholds = _per_mode(threshold, settings, "threshold", 0.5)
        self.max_draft = settings.get("max_draft", 12) if max_draft is None else max_draft
        for value in self.thresholds.values():
            if not 0 < value < 1:
                raise ValueError(f"threshold: must be in (0, 1), got {value}")
        if self.max_draft < 1:
            raise ValueError(f"max_draft: must be >= 1, got {self.max_draft}")

    def bind(self, target, draft) -> None:
        if isinstance(draft, EagleHead):
            width, device = draft.hidden_size, draft.fc.weight.device
            what = "the head's hidden state and draft_features"
        elif hasattr(getattr(draft, "config", None), "hidden_size"):
            width, what, device = draft.config.hidden_size, "the draft's hidden state and draft_features", draft.device
        else:
            raise ValueError(f"policy: SpecDecPP reads a draft model's or a feature head's hidden state; this "
                             f"drafter ({type(draft).__name__}) has neither")
        _check_width(self._predictor, width + DRAFT_EXTRA_FEATURES, what, "SpecDecPP")
        self._predictor.to(device)
        self._weights = self._predictor.weights()
        # one fused call per draft step where the kernel runs (float32 on CPU), else torch ops
        self._fused = (device.type == "cpu" and ops.registered("acceptance_head", "CPU")
                       and all(t.dtype == torch.float32 for t in self._weights))

    def _accept(self, probs: Tensor, hidden: Tensor, column: int) -> Tensor:
        if self._fused and hidden.dtype == torch.float32:
            return ops.acceptance_head(hidden, probs, self._weights, column, LAYER_NORM_EPS, validate=False)
        return torch.sigmoid(self._predictor(draft_features(hidden, probs))[:, column])

    def start(self, batch_size, greedy=True) -> None:
        super().start(batch_size, greedy)
        self._verdicts = None

    def keep_drafting(self, step, probs, tokens, hidden=None) -> Tensor:
        column = GREEDY if self.greedy else SAMPLING
        threshold = self.thresholds[self.greedy, self.batch_size > 1]
        accept = self._accept(probs, hidden, column).tolist()
        # the survival products and the verdict in Python floats: the loop syncs on the
        # verdict anyway, and each tensor op here costs ~10 us after a draft forward; the two
        # verdict tensors are made once per batch size and shared: callers read them only
        self._survival = accept if step == 1 else [s * a for s, a in zip(self._survival, accept)]
        if self._verdicts is None or len(self._verdicts[0]) != len(accept):
            self._verdicts = [torch.full((len(accept),), go, dtype=torch.bool, device=probs.device)
                              for go in (False, True)]
        going_on = 1 - sum(self._survival) / len(self._survival) <= threshold
        return self._verdicts[int(going_on)]


@register
class AdaLength(Policy):
    """AdaEAGLE's lightweight draft-length predictor: each round drafts
    ceil(predicted accepted length + ``offset``) tokens, between 1 and ``max_draft``.

    A batch drafts as one, to the mean of its rows' predicted lengths: each draft forward
    and the verification's width are paid for the longest row whatever the others draft,
    so per-row lengths drafted near the longest prediction for all (batch 8: 0.8x fixed k).

    Args:
        predictor: path of a safetensors predictor, a :class:`ResidualMLP` or None for
            the bundled pair's (``policies/adalength.safetensors``).
        offset: one value for every case, or None for the values tuned with the predictor
            (for greedy and for sampling, at batch 1 and for batches).
        max_draft: None takes the value tuned with the predictor.
    """

    uses_target_hidden = True
    uses_bonus_agreement = True

    def __init__(self, predictor=None, offset: float | None = None, max_draft: int | None = None):
        self._predictor, settings = _predictor(predictor, "adalength")
        self.offsets = _per_mode(offset, settings, "offset", 0.0)
        self.max_draft = settings.get("max_draft", 12) if max_draft is None else max_draft
        self._first = settings.get("first_round", 3)
        if self.max_draft < 1:
            raise ValueError(f"max_draft: must be >= 1, got {self.max_draft}")

    def bind(self, target, draft) -> None:
        _check_width(self._predictor, 2 * target.config.hidden_size + HISTORY_FEATURES,
                     "[target input embedding; target hidden state; history_features]", "AdaLength")
        self._embed = input_embedding(target)
        self._predictor.to(target.device)

    def start(self, batch_size, greedy=True) -> None:
        super().start(batch_size, greedy)
        self._k = [min(self._first, self.max_draft)] * batch_size
        self._before = [0] * batch_size  # positions the draft agreed on in a row before the next root
        self._features = None

    def see_target(self, hidden: Tensor, next_tokens: Tensor) -> None:
        # the round's outcome (observe) comes after this call: predict in plan()
        self._features = torch.cat([self._embed(next_tokens).float(), hidden.float()], -1)

    def observe(self, num_draft, num_accepted) -> None:
        # the run goes on through the bonus token only if the draft agrees with it too
        # (see_bonus_agreement), as the training data counts it: accepted + 1
        self._before = [min(self.max_draft, before + a + 1) if a >= n else 0
                        for before, n, a in zip(self._before, num_draft, num_accepted)]

    def see_bonus_agreement(self, agreed: Tensor) -> None:
        self._before = [before if ok else 0 for before, ok in zip(self._before, agreed.tolist())]

    def plan(self) -> list[int]:
        if self._features is not None:
            history = history_features(torch.tensor(self._before, device=self._features.device))
            column = GREEDY if self.greedy else SAMPLING
            offset = self.offsets[self.greedy, len(self._before) > 1]
            length = self._predictor(torch.cat([self._features, history], -1))[:, column].mean() + offset
            self._k = [int(length.ceil().clamp(1, self.max_draft))] * len(self._before)
            self._features = None
        return list(self._k)

    def keep_rows(self, rows) -> None:
        super().keep_rows(rows)
        self._k = [self._k[r] for r in rows]
        self._before = [self._before[r] for r in rows]
        if self._features is not None:
            self._features = self._features[torch.tensor(rows, dtype=torch.long, device=self._features.device)]


class BranchPredictor:
    """SpecBranch's branch-point predictor: a 3-class residual MLP on [target input
    embedding of a row's new root; target hidden state that produced it] -> a
    :class:`BranchHint`: REJECT_ALL (the next draft is likely rejected: branch at once),
    DEFER (branch by the draft's confidence) or ACCEPT_ALL (the next ``accept_all_length`` drafts likely all pass:
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
        self._embed = input_embedding(target)
        self._model.to(target.device)

    def classify(self, hidden: Tensor, roots: Tensor, greedy: bool) -> list[BranchHint]:
        features = torch.cat([self._embed(roots).float(), hidden.float()], -1)
        logits = self._model(features)[:, :3] if greedy else self._model(features)[:, 3:]
        return [BranchHint(c) for c in logits.argmax(-1).tolist()]


@register
class LearnedSpecBranch(SpecBranch):
    """:class:`spec_ext.policies.SpecBranch` with the bundled pair's branch-point
    predictor (``policies/branch.safetensors`` of :mod:`spec_ext.bundled`) or ``predictor`` (a path, a
    :class:`ResidualMLP` or a :class:`BranchPredictor`)."""

    def __init__(self, branches: int = 4, gamma: int | None = None, mode: str = "threads", draft_rank: int = 1,
                 timeout: float = 60.0, max_gamma: int = 12, predictor=None):
        if not isinstance(predictor, BranchPredictor):
            predictor = BranchPredictor(predictor)
        super().__init__(branches, gamma, mode, draft_rank, timeout, max_gamma, predictor)
