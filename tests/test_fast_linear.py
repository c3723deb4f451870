"""fast_linear's default ("auto"): the target's lean forward takes skinny_linear where its
measured rule says it is faster, and greedy output stays HF's on the bundled pair;
fast_linear=False keeps HF's arithmetic; bad values are refused by name."""
import pytest
import torch
import torch.nn.functional as F

import spec_ext
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
