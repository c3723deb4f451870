"""The lean forward (spec_ext.models.lean) against the HF modules it replaces: same numbers, bit for bit."""
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
from transformers.models.llama.modeling_llama import LlamaMLP

import spec_ext
from spec_ext.models import SpecCache, hf
from spec_ext.models.lean import lean_decoder, prepare, why_not_lean
from helpers import llama_family


def run_both(model, steps, fast_linear=False):
    """Feed the same (ids, positions, tree mask) steps through a fresh cache per path; the
    cache advances by the given lengths after each step. Returns [(logits, hidden)] per path."""
    results = []
    for lean in (False, True):
        cache = SpecCache.for_model(model, steps[0][0].shape[0], 640)
        outs = []
        with torch.inference_mode(), hf.attention_implementation(model, fast_linear=fast_linear):
            assert lean_decoder(model) is not None  # so use_lean=True really takes the lean forward
            for ids, positions, mask, advance in steps:
                out = hf.forward(model, ids, cache, positions, mask, hidden=True, use_lean=lean)
                outs.append((out[0], out[1]))  # logits, hidden
                cache.advance(advance)
        results.append(outs)
    return results


def lean_model(kind):
    """helpers.llama_family's models, and: Qwen3 (q/k norms), Mistral with a window of 5, Qwen2 with
    a window of 5 on its second layer only (both windows passed by the steps below)."""
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=8, **common)).eval()
    if kind == "mistral_window":
        return MistralForCausalLM(MistralConfig(sliding_window=5, **common)).eval()
    if kind == "qwen2_window":
        return Qwen2ForCausalLM(Qwen2Config(sliding_window=5, use_sliding_window=True, max_window_layers=1,
                                            **common)).eval()
    return llama_family(kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3", "mistral_window", "qwen2_window"])
def test_lean_forward_equals_hf_forward(kind, dtype):
    """Bit for bit in every dtype: the same ops in the same order, with HF's upcasts (RMSNorm
    in float32, rounded back before the weight; the rotary's cos/sin in the model's dtype)."""
    model = lean_model(kind).to(dtype)
    assert why_not_lean(model) is None
    g = torch.Generator().manual_seed(0)
    tree = spec_ext.build_tree([-1, 0, 0, 1, 2, 2])
    lengths = torch.tensor([9, 4, 1])
    steps = [(torch.randint(0, 61, (3, 9), generator=g), torch.arange(9).expand(3, 9), None, lengths.tolist()),
             (torch.randint(0, 61, (3, 6), generator=g), tree.positions(lengths), tree.mask, [1, 2, 3]),
             (torch.randint(0, 61, (3, 1), generator=g), (lengths + torch.tensor([1, 2, 3]))[:, None], None,
              [1, 1, 1])]
    reference, lean = run_both(model, steps)
    for (logits, hidden), (lean_logits, lean_hidden) in zip(reference, lean):
        assert logits.dtype == lean_logits.dtype == torch.float32
        assert torch.equal(logits, lean_logits)
        assert torch.equal(hidden, lean_hidden)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v projections with a bias
def test_fast_linear_forward_is_close_to_hf_forward(kind):
    model = llama_family(kind)
    g = torch.Generator().manual_seed(1)
    tree = spec_ext.build_tree([-1, 0, 0, 1])
    lengths = torch.tensor([7, 3])
    steps = [(torch.randint(0, 61, (2, 7), generator=g), torch.arange(7).expand(2, 7), None, lengths.tolist()),
             (torch.randint(0, 61, (2, 4), generator=g), tree.positions(lengths), tree.mask, [1, 2]),
             (torch.randint(0, 61, (2, 1), generator=g), (lengths + torch.tensor([1, 2]))[:, None], None, [1, 1])]
    reference, fast = run_both(model, steps, fast_linear=True)
    with hf.attention_implementation(model, fast_linear=True):
        assert lean_decoder(model).fast_linear == spec_ext.ops.linear.kernel_applies("cpu")
    for (logits, hidden), (fast_logits, fast_hidden) in zip(reference, fast):
        torch.testing.assert_close(fast_logits, logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fast_hidden, hidden, rtol=1e-4, atol=1e-4)


def test_fast_linear_says_when_it_cannot_apply():
    model = llama_family("llama").to(torch.bfloat16)
    with pytest.warns(UserWarning, match="fast_linear: no effect on this LlamaForCausalLM"):
        prepare(model, fast_linear=True)


def test_rotary_table_covers_every_cache_capacity():
    model = llama_family("llama")
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode(), hf.attention_implementation(model):
        for capacity, length in ((16, 12), (640, 600)):  # the second cache needs a bigger table than the first
            ids = torch.randint(0, 61, (1, length), generator=g)
            outs = [hf.forward(model, ids, SpecCache.for_model(model, 1, capacity), torch.arange(length)[None],
                               hidden=True, use_lean=lean)[0] for lean in (False, True)]
            assert torch.equal(*outs)


def test_models_the_lean_forward_does_not_know_take_the_hf_forward():
    dynamic = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=4,
                                           rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                            "rope_theta": 10000.0})).eval()
    assert "rope_type 'dynamic'" in why_not_lean(dynamic)
    prepare(dynamic)
    assert lean_decoder(dynamic) is None

    class CustomMLP(LlamaMLP):
        pass

    custom = llama_family("llama")
    custom.model.layers[1].mlp.__class__ = CustomMLP
    assert "unknown layer modules" in why_not_lean(custom)

    training = llama_family("llama").train()
    prepare(training)
    assert lean_decoder(training) is None
    assert lean_decoder(training.eval()) is not None


def test_forward_hooks_send_the_model_through_the_hf_forward():
    model = llama_family("llama")
    prepare(model)
    assert lean_decoder(model) is not None
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert "hooks or a patched forward on model.layers.0.mlp" in why_not_lean(model)
    out = spec_ext.generate(model, llama_family("llama"), [[1, 2, 3]], max_new_tokens=4, policy="fixed")
    assert lean_decoder(model) is None  # generate decided again, and the hook ran
    assert len(seen) == out.stats.target_calls


def test_lean_forward_sees_in_place_weight_updates():
    model = llama_family("llama")
    ids = torch.randint(0, 61, (1, 5))
    before = run_both(model, [(ids, torch.arange(5)[None], None, [5])])[1][0][0]
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)
    reference, lean = run_both(model, [(ids, torch.arange(5)[None], None, [5])])
    assert not torch.equal(before, lean[0][0])
    assert torch.equal(reference[0][0], lean[0][0])


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "hf_modules"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_logits_at_some_columns_are_the_full_forwards_at_those_columns(kind, lean):
    """``logits_at`` (a prompt's forward needs its last token's logits alone): per row its own
    columns, [B,n,V]; the same numbers as the whole forward's there (the LM head over fewer rows
    may sum in another order: float32 rounding apart), the hidden states untouched."""
    model = lean_model(kind)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 61, (3, 9), generator=g)
    at = torch.tensor([[8, 2], [0, 5], [3, 3]])
    outs = []
    for columns in (None, at):
        cache = SpecCache.for_model(model, 3, 32)
        with torch.inference_mode(), hf.attention_implementation(model):
            outs.append(hf.forward(model, ids, cache, torch.arange(9).expand(3, 9), hidden=True, use_lean=lean,
                                   logits_at=columns))
    full, some = outs
    assert some.logits.shape == (3, 2, 61) and some.logits.dtype == torch.float32
    torch.testing.assert_close(some.logits, full.logits.gather(1, at[..., None].expand(-1, -1, 61)), rtol=1e-5,
                               atol=1e-6)
    assert torch.equal(some.hidden, full.hidden)


def test_logits_at_on_a_model_whose_forward_takes_logits_to_keep_but_computes_every_column():
    """(remote code that takes the argument and ignores it) The whole forward's logits, gathered."""
    model = lean_model("llama")

    class Ignores(type(model)):
        def forward(self, input_ids=None, past_key_values=None, logits_to_keep=0, **kwargs):
            return super().forward(input_ids=input_ids, past_key_values=past_key_values, **kwargs)

    ignoring = Ignores(model.config).eval()
    ignoring.load_state_dict(model.state_dict())
    ids, at = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(2)), torch.tensor([[5], [1]])
    outs = []
    for m in (model, ignoring):
        cache = SpecCache.for_model(m, 2, 16)
        with torch.inference_mode(), hf.attention_implementation(m):
            outs.append(hf.forward(m, ids, cache, torch.arange(6).expand(2, 6), use_lean=False, logits_at=at).logits)
    assert outs[1].shape == (2, 1, 61)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
