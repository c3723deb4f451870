"""fast_linear's default ("auto"): the target's lean forward, and the nn.Linear layers of a
model on the HF modules (target and draft), take skinny_linear where its measured rule says
it is faster, and greedy output stays HF's (the bundled pair on either path, a Gemma2 the lean
forward refuses); the HF modules get their own forward back when the block closes, however it
closes; fast_linear=False keeps HF's arithmetic; bad values are refused by name."""
import collections
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import spec_ext
from spec_ext.models import SpecCache, attention_implementation, forward_path, hf
from spec_ext.models.lean import lean_decoder


@pytest.fixture(scope="module")
def bundled_pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from spec_ext.__main__ import DEMO_PROMPT
    from spec_ext.bundled import bundled_path
    target = AutoModelForCausalLM.from_pretrained(bundled_path("stdlib-target"), dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(bundled_path("stdlib-draft"), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(bundled_path("stdlib-target"))
    texts = [DEMO_PROMPT, "import os\n\n\ndef walk(top):\n    ", "class Stack:\n    def __init__(self):\n        "]
    ids = [tokenizer(t).input_ids for t in texts]
    return target, draft, [ids[0][:40], ids[0][:23], ids[1], ids[2]]


def hf_greedy(target, prompt, n):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_the_default_equals_hf_greedy_on_the_bundled_pair(bundled_pair):
    target, draft, prompts = bundled_pair
    for prompt in prompts:
        out = spec_ext.generate(target, draft, [prompt], max_new_tokens=48, eos_token_id=[])
        assert out.sequences[0, len(prompt):].tolist() == hf_greedy(target, prompt, 48), prompt[:8]
    # the default did put the target on the kernel where it runs (AVX2 + FMA or AVX-512)
    applies = spec_ext.ops.linear.kernel_applies("cpu")
    assert (lean_decoder(target).linear is not F.linear) == applies
    fast = spec_ext.accelerate(target, draft, policy="fixed")  # a ragged batch through accelerate's default
    out = fast.generate([prompts[1], prompts[2]], max_new_tokens=32, eos_token_id=[])
    for b, prompt in enumerate(prompts[1:3]):
        assert out[b, -32:].tolist() == hf_greedy(target, prompt, 32), b


def test_false_keeps_hf_arithmetic_for_the_target(bundled_pair):
    target, draft, prompts = bundled_pair
    out = spec_ext.generate(target, draft, [prompts[1]], max_new_tokens=8, eos_token_id=[], fast_linear=False)
    assert lean_decoder(target).linear is F.linear
    assert out.sequences[0, len(prompts[1]):].tolist() == hf_greedy(target, prompts[1], 8)


def test_bad_values_name_the_argument(bundled_pair):
    target, draft, prompts = bundled_pair
    for bad in ("yes", 1, None, "Auto"):
        with pytest.raises(ValueError, match="fast_linear: expected 'auto', True or False, got"):
            spec_ext.generate(target, draft, [prompts[1]], max_new_tokens=2, fast_linear=bad)
        with pytest.raises(ValueError, match="fast_linear: expected 'auto', True or False, got"):
            spec_ext.accelerate(target, draft, fast_linear=bad)


# --- the HF-modules path (models the lean forward cannot reproduce, or kept off it by hf_modules) ---

class KernelCalls(TorchDispatchMode):
    """Counts the calls of spec_ext's skinny_linear kernel, by the data pointer of the weight
    each call read (so by layer and model), from outside: the dispatcher sees every call."""

    def __init__(self):
        super().__init__()
        self.weights = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.spec_ext.skinny_linear.default:
            self.weights[args[1].data_ptr()] += 1
        return func(*args, **(kwargs or {}))

    def layers_of(self, model) -> int:
        """How many of ``model``'s nn.Linear layers the kernel ran."""
        return sum(self.weights[m.weight.data_ptr()] > 0 for m in linear_layers(model))


def linear_layers(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def untouched(model) -> bool:
    """Every nn.Linear of ``model`` runs nn.Linear.forward (no forward of its own)."""
    return all("forward" not in m.__dict__ for m in linear_layers(model))


def gemma2(seed):
    """A 2-layer Gemma2 (soft-capped, windowed: the lean forward refuses it), vocabulary 97,
    weights sharpened so that argmaxes are clear of float32 rounding."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def hf_pair():
    from helpers import perturbed
    target = gemma2(0)
    return target, perturbed(target, 0.01, seed=1)


HF_PROMPTS = [[5, 17, 33, 8, 9, 10, 11], [40, 3], [7, 21, 50, 4, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]


def test_the_default_routes_hf_modules_target_and_draft_and_equals_hf_greedy(hf_pair):
    target, draft = hf_pair
    applies = spec_ext.ops.linear.kernel_applies("cpu")
    for prompt in HF_PROMPTS:
        with KernelCalls() as calls:
            out = spec_ext.generate(target, draft, [prompt], max_new_tokens=40, eos_token_id=[], policy="fixed")
        assert forward_path(target).startswith("hf: unknown layer modules")
        assert forward_path(draft).startswith("hf: unknown layer modules")
        assert out.sequences[0, len(prompt):].tolist() == hf_greedy(target, prompt, 40), prompt
        # every linear layer of both models (7 per decoder layer, the LM head) ran on the kernel
        assert calls.layers_of(target) == (len(linear_layers(target)) if applies else 0) == (15 if applies else 0)
        assert calls.layers_of(draft) == (15 if applies else 0)
        assert untouched(target) and untouched(draft)


def test_false_keeps_hf_arithmetic_on_the_hf_modules(hf_pair):
    target, draft = hf_pair
    prompt = HF_PROMPTS[0]
    with KernelCalls() as calls:
        out = spec_ext.generate(target, draft, [prompt], max_new_tokens=24, eos_token_id=[], fast_linear=False,
                                policy="fixed")
    assert out.sequences[0, len(prompt):].tolist() == hf_greedy(target, prompt, 24)
    assert calls.layers_of(target) == 0  # the draft takes the kernel whatever fast_linear says
    assert calls.layers_of(draft) == (15 if spec_ext.ops.linear.kernel_applies("cpu") else 0)

    def logits(fast_linear):
        cache = SpecCache.for_model(target, 1, 32)
        with torch.inference_mode(), attention_implementation(target, fast_linear=fast_linear), \
                KernelCalls() as calls:
            out = hf.forward(target, torch.tensor([prompt]), cache, torch.arange(len(prompt))[None]).logits
        return out, calls.layers_of(target)

    before, kernel_layers = logits(False)
    assert kernel_layers == 0
    fast, kernel_layers = logits("auto")
    assert kernel_layers == (15 if spec_ext.ops.linear.kernel_applies("cpu") else 0)
    torch.testing.assert_close(fast, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits(False)[0], before)  # HF's own bits again after a routed block


def test_the_bundled_pair_on_hf_modules_equals_hf_greedy_through_the_default(bundled_pair):
    target, draft, prompts = bundled_pair
    applies = spec_ext.ops.linear.kernel_applies("cpu")
    with spec_ext.models.hf_modules(target, draft):
        for prompt in prompts[1:]:
            with KernelCalls() as calls:
                out = spec_ext.generate(target, draft, [prompt], max_new_tokens=32, eos_token_id=[])
            assert out.sequences[0, len(prompt):].tolist() == hf_greedy(target, prompt, 32), prompt[:8]
            assert calls.layers_of(target) == (len(linear_layers(target)) if applies else 0)
            assert calls.layers_of(draft) == (len(linear_layers(draft)) if applies else 0)
    assert untouched(target) and untouched(draft)


@pytest.mark.skipif(not spec_ext.ops.linear.kernel_applies("cpu"), reason="routing applies only where the "
                    "kernel runs (x86-64 CPU with AVX2 + FMA or AVX-512, float32)")
def test_routing_is_undone_after_the_block_an_exception_and_nested_blocks(hf_pair):
    """Routing is per thread: the newest block this thread opened decides whether its forwards
    take the kernel (every layer or none), a block of another thread changes nothing here, and
    the modules are handed back untouched when the last block closes."""
    target, _ = hf_pair
    layers = linear_layers(target)

    def kernel_layers():
        """The target's nn.Linear layers that took the kernel in one forward on this thread."""
        cache = SpecCache.for_model(target, 1, 8)
        with torch.inference_mode(), KernelCalls() as calls:
            hf.forward(target, torch.tensor([[5, 6]]), cache, torch.arange(2)[None])
        return calls.layers_of(target)

    with attention_implementation(target, fast_linear="auto"):
        assert all("forward" in m.__dict__ for m in layers) and kernel_layers() == len(layers)
        with attention_implementation(target, fast_linear=False):  # the newest block's setting applies
            assert kernel_layers() == 0
        assert all("forward" in m.__dict__ for m in layers) and kernel_layers() == len(layers)
        with attention_implementation(target, fast_linear=True):  # a nested block with the same setting
            assert all("forward" in m.__dict__ for m in layers) and kernel_layers() == len(layers)
        assert all("forward" in m.__dict__ for m in layers) and kernel_layers() == len(layers)
        opened, close, seen = threading.Event(), threading.Event(), {}

        def other_thread():  # a block of another thread (PEARL's draft side) opens and closes inside this one
            with attention_implementation(target, fast_linear=False):
                seen["there"] = kernel_layers()
                opened.set()
                close.wait(10)

        thread = threading.Thread(target=other_thread)
        thread.start()
        assert opened.wait(10) and seen["there"] == 0  # that thread's block: F.linear there
        assert kernel_layers() == len(layers)  # this thread's block still routes here
        close.set()
        thread.join()
        assert all("forward" in m.__dict__ for m in layers) and kernel_layers() == len(layers)
    assert untouched(target)
    with pytest.raises(RuntimeError, match="inside"):
        with attention_implementation(target, fast_linear="auto"):
            raise RuntimeError("inside")
    assert untouched(target)
    with pytest.raises(ValueError, match="fast_linear: expected"):  # the second model fails to open
        with attention_implementation(target, target, fast_linear=["auto", "yes"]):
            pass
    assert untouched(target)


@pytest.mark.skipif(not spec_ext.ops.linear.kernel_applies("cpu"), reason="routing applies only where the "
                    "kernel runs (x86-64 CPU with AVX2 + FMA or AVX-512, float32)")
def test_routing_keeps_hooks_leaves_patched_layers_and_gradients_to_f_linear(hf_pair):
    target, _ = hf_pair
    seen = []
    hook = target.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    patched = target.model.layers[0].mlp.down_proj
    patched.forward = lambda x: F.linear(x, patched.weight)  # an offloading library's, say
    prompt = torch.tensor([HF_PROMPTS[1]])
    try:
        cache = SpecCache.for_model(target, 1, 8)
        with torch.inference_mode(), attention_implementation(target, fast_linear="auto"), KernelCalls() as calls:
            assert forward_path(target).startswith("hf: forward hooks or a patched forward on model.layers.0")
            hf.forward(target, prompt, cache, torch.arange(2)[None])
        assert seen.pop() == (1, 2, 97)
        assert calls.weights[patched.weight.data_ptr()] == 0
        assert calls.layers_of(target) == 14
        assert "forward" in patched.__dict__ and untouched(target.model.layers[1])
        with attention_implementation(target, fast_linear="auto"), KernelCalls() as calls:  # the kernel has no backward
            out = target.model.layers[1].mlp.down_proj(torch.randn(2, 96))
        assert out.requires_grad and calls.layers_of(target) == 0
    finally:
        hook.remove()
        del patched.forward
