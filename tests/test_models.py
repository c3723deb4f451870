"""The model layer on its own: SpecCache takes its shape from the keys the model's attention
writes, attention_implementation blocks nest with the same model (on one thread and across
two, closing in either order), and the two model checks answer two questions."""
import threading

import pytest
import torch
import transformers

from spec_ext.models import SpecCache, forward_path, hf, hf_modules, lean, unsupported_reason
from helpers import llama, perturbed

TARGET_VOCAB = 61


def gpt2(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=TARGET_VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**dict(config, **overrides))).eval()


def short_draft():
    """A Llama (the lean forward's family) whose vocabulary lacks the target's last 8 rows."""
    draft = perturbed(llama(TARGET_VOCAB, 32, 2, seed=0), 0.01, seed=1)
    draft.resize_token_embeddings(53, mean_resizing=False)
    draft.config.vocab_size = 53
    return draft


IDS = torch.tensor([[5, 17, 33, 8]])


def spec_logits(model):
    """One spec_ext forward of IDS over a fresh cache, in whatever block is open."""
    with torch.no_grad():
        return hf.forward(model, IDS, SpecCache.for_model(model, 1, 16), torch.arange(IDS.shape[1])[None]).logits


def padded_reference(model, width):
    """HF's own forward (its default attention, no spec_ext), padded as spec_ext pads a
    vocabulary: the missing columns get the lowest float."""
    with torch.no_grad():
        logits = model(IDS).logits.float()
    return torch.cat([logits, logits.new_full((*logits.shape[:-1], width - logits.shape[-1]),
                                              torch.finfo(logits.dtype).min)], -1)


# ---------------------------------------------------------------- SpecCache's shape
def test_the_cache_takes_the_shape_the_attention_writes_not_the_configs_kv_heads():
    """A GPT-2 config that carries num_key_value_heads=2 (GPT-2 ignores it: 4 heads attend)."""
    model = gpt2(num_key_value_heads=2)
    cache = SpecCache.for_model(model, 1, 16)
    with hf.attention_implementation(model), torch.no_grad():
        logits = hf.forward(model, IDS, cache, torch.arange(4)[None]).logits
    assert cache.buffer.shape == (4, 1, 4, 16, 8)  # 2 layers x (K, V), 4 heads of 8 dims
    torch.testing.assert_close(logits, padded_reference(model, TARGET_VOCAB))


def test_a_cache_refuses_keys_of_another_shape_by_name():
    cache = SpecCache(num_layers=2, num_kv_heads=None, head_dim=None, batch_size=2, capacity=8)
    cache.update(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8), 0)
    with pytest.raises(ValueError, match=r"layer 1 writes keys \(2, 2, 3, 8\).*holds 4 heads of 8 key dims and 8 value dims"):
        cache.update(torch.zeros(2, 2, 3, 8), torch.zeros(2, 2, 3, 8), 1)
    with pytest.raises(ValueError, match=r"layer 1 writes keys \(2, 4, 3, 8\) and values \(2, 4, 3, 16\)"):
        cache.update(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 16), 1)
    with pytest.raises(ValueError, match="num_kv_heads, head_dim: give both or neither"):
        SpecCache(num_layers=2, num_kv_heads=4, head_dim=None, batch_size=2, capacity=8)


# ---------------------------------------------------------------- nested blocks
def test_a_nested_block_with_the_same_model_hands_the_outer_settings_back():
    """PEARL's draft thread opens a block for the draft inside the caller's: when it closes,
    the outer block's padded vocabulary and lean forward are the draft's again."""
    draft = short_draft()
    original, reference = draft.config._attn_implementation, padded_reference(draft, TARGET_VOCAB)
    with hf.attention_implementation(draft, vocab_size=TARGET_VOCAB):
        outer_decoder = lean.lean_decoder(draft)
        assert outer_decoder is not None and forward_path(draft) == "lean"
        with hf_modules(draft), hf.attention_implementation(draft):  # its own vocabulary, the HF modules
            assert spec_logits(draft).shape[-1] == 53 and forward_path(draft).startswith("hf: forced")
        torch.testing.assert_close(spec_logits(draft), reference)  # the target's width again
        assert draft.config._attn_implementation == hf.ATTENTION
        assert lean.lean_decoder(draft) is outer_decoder and forward_path(draft) == "lean"
    assert draft.config._attn_implementation == original
    with hf.attention_implementation(draft):  # no padding left behind
        assert spec_logits(draft).shape[-1] == 53


@pytest.mark.parametrize("order", ["inner closes first", "outer closes first"])
def test_blocks_on_two_threads_close_in_either_order(order):
    """The caller's block (target and draft, padded vocabulary) on this thread, the draft's
    own block on another; whichever closes first, the other's settings hold until it closes,
    and the model gets its own attention back when both have."""
    target, draft = llama(TARGET_VOCAB, 32, 2, seed=0), short_draft()
    original, reference = draft.config._attn_implementation, padded_reference(draft, TARGET_VOCAB)
    opened, close, closed = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def draft_thread():
        with hf.attention_implementation(draft, vocab_size=TARGET_VOCAB):
            opened.set()
            close.wait(60)
            seen["inside"] = spec_logits(draft)
            seen["implementation"] = draft.config._attn_implementation
        closed.set()

    with hf.attention_implementation(target, draft, vocab_size=TARGET_VOCAB):
        thread = threading.Thread(target=draft_thread)
        thread.start()
        assert opened.wait(60)
        if order == "inner closes first":
            close.set()
            assert closed.wait(60)
            seen["outer after"] = spec_logits(draft)
            assert draft.config._attn_implementation == hf.ATTENTION
    if order == "outer closes first":
        # blocks are per thread: this thread has none open now (the draft thread's still is)
        assert draft.config._attn_implementation == original
        assert target.config._attn_implementation == original  # the target had one block only
        close.set()
        assert closed.wait(60)
    thread.join(60)
    assert seen["implementation"] == hf.ATTENTION
    torch.testing.assert_close(seen["inside"], reference)
    if order == "inner closes first":
        torch.testing.assert_close(seen["outer after"], reference)
    assert draft.config._attn_implementation == target.config._attn_implementation == original


def test_a_block_that_fails_to_open_leaves_no_setting_behind():
    target, draft = llama(TARGET_VOCAB, 32, 2, seed=0), short_draft()
    original = draft.config._attn_implementation
    with pytest.raises(ValueError, match="fast_linear: expected False, True or 'auto'"):
        with hf.attention_implementation(target, draft, fast_linear=[False, "fast"], vocab_size=TARGET_VOCAB):
            pass
    assert target.config._attn_implementation == draft.config._attn_implementation == original
    with hf.attention_implementation(draft):  # no padding left behind
        assert spec_logits(draft).shape[-1] == 53


# ---------------------------------------------------------------- the two model checks
def test_decodable_and_lean_are_two_questions_with_two_names():
    """GPT-2: spec_ext decodes it (on the HF modules), the lean forward does not reproduce it."""
    model = gpt2()
    assert unsupported_reason(model) is None
    assert lean.why_not_lean(model) == "not a *ForCausalLM with .model.layers and .lm_head"
    assert lean.why_not_lean(llama(TARGET_VOCAB, 32, 2, seed=0)) is None
    assert not hasattr(lean, "unsupported_reason")
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=TARGET_VOCAB, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    assert "encoder-decoder" in unsupported_reason(t5)
