"""Features for draft heads that read the target's hidden states (EAGLE-3):
``forward(..., layers=ks)`` returns HF's own ``hidden_states[k]`` of the same positions,
concatenated, on the lean forward and on the HF modules, for a ragged batch over a SpecCache
(a prefix, then a chain, then a tree, each node against the run of its own path); asking
for them changes no other output."""
import types

import pytest
import torch

import spec_ext
from spec_ext.models import Forward, SpecCache, aux_layer_ids, forward_path, hf, hf_modules, num_layers
from test_architectures import sharpened_model

L = 6  # layers: (0, 2, L // 2, L) are four distinct entries, and aux_layer_ids gives (2, 3, 3)
LAYERS = (0, 2, L // 2, L)
LEAN = ["llama", "qwen3"]
HF_MODULES = ["gpt2", "gemma2", "gpt_neox", "phi3", "gemma3", "gpt_oss"]
TOLERANCE = dict(rtol=1e-5, atol=1e-5)

# a ragged batch of 3 rows: prefixes of 7, 3 and 5 tokens (row 1 and 2 padded to 7 in the
# prefix forward), then a chain of 3 new tokens of which the rows keep 3, 1 and 2, then a
# tree of 6 nodes (two branches off the root, each branching again) past every window of 6
PREFIXES = [[5, 17, 33, 8, 9, 10, 11], [40, 3, 22], [7, 21, 50, 4, 30]]
FILLER = 13
CHAINS = [[12, 44, 6], [25, 25, 9], [60, 3, 18]]
KEPT = [3, 1, 2]
PARENTS = [-1, 0, 0, 1, 2, 2]
TREES = [[14, 27, 39, 52, 8, 19], [33, 6, 47, 20, 11, 58], [4, 16, 28, 35, 42, 57]]

_MODELS: dict = {}


def model_of(kind: str):
    """A 6-layer ``kind`` of tests/test_architectures.py (its windows, soft-caps, sinks and
    experts), shared by the module."""
    if kind not in _MODELS:
        overrides = dict(n_layer=L) if kind == "gpt2" else dict(num_hidden_layers=L)
        if kind in ("gemma3", "gpt_oss"):  # they alternate sliding and full layers
            overrides["layer_types"] = ["sliding_attention", "full_attention"] * (L // 2)
        _MODELS[kind] = sharpened_model(kind, **overrides)
        assert num_layers(_MODELS[kind]) == L
    return _MODELS[kind]


@torch.no_grad()
def hf_states(model, sequence, layers=LAYERS):
    """HF's own forward of one full sequence (its default attention, no spec_ext): logits
    [S,V] and the hidden states ``layers`` concatenated [S,len(layers)*H]."""
    out = model(torch.tensor([sequence]), output_hidden_states=True)
    assert len(out.hidden_states) == L + 1
    return out.logits[0].float(), torch.cat([out.hidden_states[k][0] for k in layers], -1)


def steps():
    """(input_ids, positions, tree_mask, how the cache advances after it) of the three forwards."""
    lengths = torch.tensor(list(map(len, PREFIXES)))
    tree = spec_ext.build_tree(PARENTS)
    prefix = torch.tensor([p + [FILLER] * (7 - len(p)) for p in PREFIXES])
    chain_positions = lengths[:, None] + torch.arange(3)
    after_chain = lengths + torch.tensor(KEPT)
    return [(prefix, torch.arange(7).expand(3, 7), None, ("advance", lengths.tolist())),
            (torch.tensor(CHAINS), chain_positions, None, ("advance", KEPT)),
            (torch.tensor(TREES), tree.positions(after_chain), tree.mask, None)]


def run(model, use_lean=True, hidden=False, layers=LAYERS, vocab_size=None):
    """The three forwards over one SpecCache; returns each forward's output."""
    cache = SpecCache.for_model(model, 3, 32)
    outs = []
    with torch.inference_mode(), hf.attention_implementation(model, vocab_size=vocab_size):
        for ids, positions, mask, advance in steps():
            outs.append(hf.forward(model, ids, cache, positions, mask, hidden=hidden, use_lean=use_lean,
                                   layers=layers))
            if advance is not None:
                getattr(cache, advance[0])(advance[1])
        path = forward_path(model) if use_lean else "hf"
    return outs, path


def path_to(node: int) -> list[int]:
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = PARENTS[node]
    return nodes[::-1]


def check_against_hf(model, outs, layers=LAYERS):
    """Every position of every forward against HF's full-sequence run of that row: the
    prefix's own tokens, every chain token, every tree node (the run of its root path)."""
    (prefix_logits, _, prefix_features), (chain_logits, _, chain_features), (tree_logits, _, tree_features) = outs
    H = model.config.hidden_size
    assert prefix_features.shape == (3, 7, len(layers) * H) and prefix_features.dtype == model.dtype
    assert tree_features.shape == (3, len(PARENTS), len(layers) * H)
    for b, prefix in enumerate(PREFIXES):
        n = len(prefix)
        logits, features = hf_states(model, prefix + CHAINS[b], layers)
        torch.testing.assert_close(prefix_features[b, :n], features[:n], **TOLERANCE)
        torch.testing.assert_close(prefix_logits[b, :n], logits[:n], **TOLERANCE)
        torch.testing.assert_close(chain_features[b], features[n:], **TOLERANCE)
        torch.testing.assert_close(chain_logits[b], logits[n:], **TOLERANCE)
        committed = prefix + CHAINS[b][:KEPT[b]]
        for leaf in (3, 4, 5):  # every node lies on the path to a leaf
            nodes = path_to(leaf)
            logits, features = hf_states(model, committed + [TREES[b][i] for i in nodes], layers)
            torch.testing.assert_close(tree_features[b, nodes], features[len(committed):], **TOLERANCE)
            torch.testing.assert_close(tree_logits[b, nodes], logits[len(committed):], **TOLERANCE)


@pytest.mark.parametrize("kind", LEAN + HF_MODULES)
def test_features_equal_hf_hidden_states_over_prefix_chain_and_tree(kind):
    model = model_of(kind)
    outs, path = run(model)
    assert path.split(":")[0] == ("lean" if kind in LEAN else "hf")
    check_against_hf(model, outs)


@pytest.mark.parametrize("kind", LEAN)
def test_the_lean_features_equal_the_hf_modules_bit_for_bit(kind):
    model = model_of(kind)
    lean, path = run(model, hidden=True)
    assert path == "lean"
    with hf_modules(model):
        modules, path = run(model, hidden=True)
    assert path.startswith("hf: forced")
    for a, b in zip(lean, modules):
        for x, y in zip(a, b):  # logits, hidden state, features
            assert torch.equal(x, y)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("layers", [(L, 1, 1), (3,)])
def test_layers_in_any_order_and_repeated(kind, layers):
    model = model_of(kind)
    check_against_hf(model, run(model, layers=layers)[0], layers)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2", "gemma2"])
def test_without_layers_every_output_is_as_before(kind):
    """Asking for features changes neither the logits nor the last hidden state (bit for bit),
    and what was not asked for is None (``Forward``'s fields). The last hidden state is the
    features' k = L entry, the same tensor."""
    model = model_of(kind)
    H = model.config.hidden_size
    for use_lean in (True, False):
        plain, _ = run(model, use_lean, layers=None)
        with_hidden, _ = run(model, use_lean, hidden=True, layers=None)
        with_features, _ = run(model, use_lean, layers=LAYERS)
        all_three, _ = run(model, use_lean, hidden=True, layers=LAYERS)
        for p, h, f, a in zip(plain, with_hidden, with_features, all_three):
            assert all(isinstance(out, Forward) for out in (p, h, f, a))
            assert isinstance(p.logits, torch.Tensor) and p.logits.dtype == torch.float32
            assert p.hidden is None and p.features is None and h.features is None and f.hidden is None
            assert all(x is not None for x in (h.hidden, f.features, a.hidden, a.features))
            assert all(torch.equal(p.logits, x.logits) for x in (h, f, a))
            assert torch.equal(h.hidden, a.hidden) and torch.equal(f.features, a.features)
            assert torch.equal(a.hidden, a.features[..., -H:])


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_features_with_a_padded_vocabulary(kind):
    """Inside ``attention_implementation(..., vocab_size=V)`` the logits are fitted to V (wider
    or narrower than the model's 61) and the hidden state and features are the model's own."""
    model = model_of(kind)
    own, _ = run(model, hidden=True)
    wide, _ = run(model, hidden=True, vocab_size=64)
    narrow, _ = run(model, hidden=True, vocab_size=59)
    for o, w, n in zip(own, wide, narrow):
        assert w[0].shape[-1] == 64 and n[0].shape[-1] == 59
        assert torch.equal(w[0][..., :61], o[0]) and torch.equal(n[0], o[0][..., :59])
        assert (w[0][..., 61:] == torch.finfo(torch.float32).min).all()
        for x in (w, n):
            assert torch.equal(x[1], o[1]) and torch.equal(x[2], o[2])


def test_aux_layer_ids_are_vllms_and_clamped_below_four_layers():
    def of(layers):
        return aux_layer_ids(types.SimpleNamespace(config=types.SimpleNamespace(num_hidden_layers=layers)))

    assert of(32) == (2, 16, 29) and of(80) == (2, 40, 77) and of(28) == (2, 14, 25)
    assert of(4) == (2, 2, 1) and of(6) == (2, 3, 3)
    assert [of(n) for n in (1, 2, 3)] == [(0, 0, 0), (1, 1, 0), (2, 1, 0)]
    with pytest.raises(ValueError, match="0 decoder layers"):
        of(0)
    model = model_of("gpt2")
    assert aux_layer_ids(model) == (2, 3, 3)
    check_against_hf(model, run(model, layers=aux_layer_ids(model))[0], aux_layer_ids(model))


@pytest.mark.parametrize("layers", [(L + 1,), (-1,), (True,), (1.0,), (), 3, "0"])
def test_layers_that_name_no_hidden_state_are_refused(layers):
    model = model_of("llama")
    with torch.inference_mode(), hf.attention_implementation(model), pytest.raises(ValueError, match="layers: "):
        hf.forward(model, torch.tensor([[5, 6]]), SpecCache.for_model(model, 1, 8), torch.arange(2)[None],
                   layers=layers)
