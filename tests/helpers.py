"""Helpers shared by the tests: backend parameters, tiny models, exact distributions."""
import copy

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import spec_ext
from spec_ext import ops
from spec_ext.ops import registry
from spec_ext.policies import AdaLength, Call, LearnedSpecBranch, ResidualMLP, RoundState, SpecDecPP, resolve
from spec_ext.policies.learned import DRAFT_EXTRA_FEATURES, HISTORY_FEATURES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def backend_params(op: str, with_torch: bool = False):
    """One pytest param per backend of ``op``; those that cannot run here are skipped with the
    reason. The torch backend *is* ``spec_ext.reference``: a test that compares a backend with
    the reference would compare it with itself, so it is left out unless the call site asks
    (``with_torch=True``: the expectation does not come from the reference, e.g. a hand
    computation or the target distribution)."""
    params = []
    status = ops.backends()
    for name in registry.backends_of(op):
        if name == "torch" and not with_torch:
            continue
        reason = None
        if name == "cpu" and not ops.registered(op, "CPU"):
            reason = status["cpu"]
        elif name == "cuda" and (DEVICE != "cuda" or not ops.registered(op, "CUDA")):
            reason = status["cuda"]
        elif name.startswith("triton") and status["triton"] != "available":
            reason = status["triton"]
        marks = [pytest.mark.skip(reason=f"{name} backend {reason}")] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def interpreted(backend: str) -> bool:
    """Whether ``backend`` runs in the Triton interpreter here (Python, about 30-150 ms per
    verified row): tests size their samples down for it and say so."""
    return backend.startswith("triton") and DEVICE == "cpu"


def device_for(backend: str) -> str:
    """Tensors for a backend: CPU for torch/cpu, the GPU (or the Triton interpreter's CPU) otherwise."""
    return "cpu" if backend in ("torch", "cpu") else DEVICE


def random_parents(B, T, generator):
    parents = torch.full((B, T), -1, dtype=torch.int64)
    for i in range(1, T):
        parents[:, i] = torch.randint(0, i, (B,), generator=generator)
    return parents


def llama_family(kind):
    """A 2-layer Llama, Qwen2 or Mistral (``kind``; Mistral without a window), vocabulary 61,
    as initialised from seed 0 (no sharpening, no pad id), for the lean-forward and SpecCache
    tests. tests/test_architectures.py builds every architecture, sharpened (``sharpened_model``)."""
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    return MistralForCausalLM(MistralConfig(sliding_window=None, **common)).eval()




def llama(vocab, hidden, layers, seed, sharpen=1.0, max_positions=256):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def perturbed(model, scale, seed):
    """A copy of ``model`` with Gaussian noise (std ``scale``, drawn from ``seed``) added to
    every weight: a draft that agrees with it often, not always."""
    torch.manual_seed(seed)
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for p in copy_.parameters():
            p.add_(torch.randn_like(p) * scale)
    return copy_


def plan_of(policy, rows: int, greedy: bool = True, target=None, draft=None, text=None):
    """The first round's plan of ``policy`` (a Policy or a name) for ``rows`` rows: what its
    controller for such a call plans (``text``: the rows' TextLookup, for text policies)."""
    controller = resolve(policy).start(Call(rows, greedy, target, draft))
    return controller.plan(RoundState(rows, text))


def make_policy(name, target, draft):
    """The policy called ``name``; the learned ones get untrained predictors sized for these
    tiny models (the bundled predictors fit the bundled pair only), set to draft varied lengths."""
    torch.manual_seed(0)
    if name == "specdecpp":
        return SpecDecPP(ResidualMLP(draft.config.hidden_size + DRAFT_EXTRA_FEATURES), threshold=0.9, max_draft=6)
    if name == "adalength":
        return AdaLength(ResidualMLP(2 * target.config.hidden_size + HISTORY_FEATURES), offset=2.0, max_draft=6)
    if name == "learnedspecbranch":
        return LearnedSpecBranch(predictor=ResidualMLP(2 * target.config.hidden_size, out_features=6))
    return name


def hf_greedy(model, prompt, max_new, eos):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def ragged_greedy_equals_target(target, draft, prompts, policy="fixed", max_new=30, eos_steps=None):
    """spec_ext (``policy``: a name or a policy object) on the left-padded batch of ``prompts``
    equals ``target.generate`` row by row (greedy), with an EOS that ends row 0 before
    ``max_new`` and rows that finish padded with 0 after it, as HF pads them. Returns the Output.

    The EOS is the first token row 0's own continuation produces for the first time at a step
    in ``eos_steps`` (default: 6 up to ``max_new - 1``); for a continuation that repeats itself
    over all of them, the token at the last of those steps, which then ends the row where it
    first appears (at once, for a model that repeats its first token)."""
    eos_steps = range(6, max_new) if eos_steps is None else eos_steps
    free_run = hf_greedy(target, prompts[0], max_new, eos=[])
    eos = next((free_run[i] for i in eos_steps if free_run[i] not in free_run[:i]), free_run[eos_steps[-1]])
    L = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    out = spec_ext.generate(target, draft, input_ids, attention_mask=mask, max_new_tokens=max_new,
                            eos_token_id=eos, pad_token_id=0, policy=policy)
    assert torch.equal(out.sequences[:, :L], input_ids)
    for b, prompt in enumerate(prompts):
        expected = hf_greedy(target, prompt, max_new, eos=eos)
        got = out.sequences[b, L:].tolist()
        assert got == expected + [0] * (len(got) - len(expected)), f"row {b}"
        if b == 0:  # the EOS ends row 0 by the last EOS step, before max_new
            assert expected[-1] == eos and len(expected) <= min(eos_steps[-1] + 1, max_new - 1), expected
    return out


# ------------------------------------------------------------------- exact distribution
VOCAB = 8
PROMPT = [1, 3, 5]


@torch.no_grad()
def exact_joint(target, sampler, steps=3, prompt=PROMPT):
    """P(x1..x_steps | prompt) under the processed target distribution, by enumeration."""
    joint = {(): 1.0}
    for _ in range(steps):
        prefixes = list(joint)
        ids = torch.tensor([list(prompt) + list(p) for p in prefixes])
        probs = sampler.probs(target(ids).logits[:, -1]).double()
        joint = {p + (x,): joint[p] * float(probs[i, x]) for i, p in enumerate(prefixes) for x in range(VOCAB)}
    return joint


def assert_follows(samples: np.ndarray, joint: dict):
    outcomes = list(joint)
    index = {o: i for i, o in enumerate(outcomes)}
    expected = np.array([joint[o] for o in outcomes])
    codes = [index.get(tuple(row), -1) for row in samples.tolist()]
    assert -1 not in codes and all(expected[c] > 0 for c in codes), "an impossible sequence was sampled"
    counts = np.bincount(codes, minlength=len(outcomes)).astype(float)
    expected = expected / expected.sum() * len(samples)
    big = expected >= 5  # pool rare outcomes so the chi-square approximation holds
    observed_bins = np.append(counts[big], counts[~big].sum())
    expected_bins = np.append(expected[big], expected[~big].sum())
    keep = expected_bins > 0
    p_value = chisquare(observed_bins[keep], expected_bins[keep]).pvalue
    assert p_value > 1e-4, p_value


# ------------------------------------------------------------------- draft trees
def eagle2_paths(logp, policy) -> set[tuple[int, ...]]:
    """The token paths EAGLE-2 keeps (``DynamicTree``), from ``logp(path)``: the drafter's
    log-probabilities [V] after a path of tokens from the root, computed by the caller."""
    policy = policy.tree_shape()
    frontier, nodes = [((), 0.0)], []
    for _ in range(policy.depth):
        children = []
        for path, score in frontier:
            values, ids = logp(path).topk(policy.top_k)
            children += [(path + (int(t),), score + float(v)) for v, t in zip(values, ids)]
        nodes += children  # every child is a candidate (EAGLE-2 reranks them all)
        frontier = sorted(children, key=lambda c: -c[1])[:policy.top_k]
    return {path for path, _ in sorted(nodes, key=lambda c: (-c[1], len(c[0])))[:policy.nodes - 1]}


def tree_paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """The token path from the root to every node of a tree (parents before children)."""
    paths = {}
    for i in range(1, len(tokens)):
        assert 0 <= parents[i] < i, parents
        paths[i] = paths.get(parents[i], ()) + (tokens[i],)
    return set(paths.values())


class CollectingStreamer:
    """A streamer (HF's put/end protocol) that keeps every chunk it is given."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


# ------------------------------------------------------------------- tokenizers
def byte_tokenizer(merges=(("a", "b"), ("c", "a"), ("ab", "c"))):
    """A byte-level BPE tokenizer made here: every byte a token, then ``merges``; id 0 the
    EOS (and pad) "<eos>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<eos>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")
