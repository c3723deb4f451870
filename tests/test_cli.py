"""The command line: help and argument errors before any heavy import, one-line errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spec_ext.__main__ import POLICY_NAMES
from spec_ext.policies import POLICIES

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, "-m", "spec_ext", *args], capture_output=True, text=True)


def test_policy_choices_are_the_registry():
    assert list(POLICY_NAMES) == sorted(POLICIES)


def test_help_loads_neither_torch_nor_transformers_and_shows_choices_and_defaults():
    check = ("import sys, contextlib, io\nimport spec_ext.__main__ as cli\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
             "    try:\n        cli.main(['generate', '--help'])\n    except SystemExit:\n        pass\n"
             "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)\n"
             "print(out.getvalue())")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "{adalength,adaptive,auto," in out.stdout and "(default: auto)" in out.stdout
    assert "(default: 128)" in out.stdout


def test_bad_arguments_are_one_line_errors_before_any_model_loads(tmp_path):
    out = run("generate", "--target", str(tmp_path), "--draft", str(tmp_path), "--prompt", "x")
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].endswith(
        f"argument --target: no Hugging Face model folder (config.json) at {tmp_path}")
    out = run("demo", "--policies", "fixd")
    assert out.returncode == 2 and "invalid choice: 'fixd'" in out.stderr and "Traceback" not in out.stderr
    out = run("generate", "--target", str(ROOT / "models" / "stdlib-target"), "--prompt", "x", "--fast-linear", "yes")
    assert out.returncode == 2 and "argument --fast-linear: invalid choice: 'yes'" in out.stderr
    out = run("demo", "--max-new-tokens", "0")
    assert out.returncode == 2 and "must be at least 1, got 0" in out.stderr


def test_backends_prints_each_backends_status():
    import spec_ext
    out = run("backends")
    assert out.returncode == 0, out.stderr
    status, _ = json.JSONDecoder().raw_decode(out.stdout)
    assert status == spec_ext.backends() and set(status) >= {"torch", "cpu", "triton", "cuda"}


@pytest.mark.parametrize("fast_linear", [[], ["--fast-linear", "off"], ["--fast-linear", "on"]],
                         ids=["default", "off", "on"])
def test_generate_streams_the_targets_greedy_completion_and_prints_the_stats(fast_linear):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target_dir, draft_dir = ROOT / "models" / "stdlib-target", ROOT / "models" / "stdlib-draft"
    prompt = "import os\n\n\ndef read_config(path):\n"
    out = run("generate", "--target", str(target_dir), "--draft", str(draft_dir), "--prompt", prompt,
              "--max-new-tokens", "12", "--policy", "fixed", *fast_linear)
    assert out.returncode == 0, out.stderr
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert expected.shape[1] == ids.shape[1] + 12, "the completion should not stop early here"
    text = tokenizer.decode(expected[0])
    assert out.stdout.startswith(text), (out.stdout, text)
    stats = json.loads(out.stdout[len(text):])
    assert stats["new_tokens"] == 12 and stats["target_calls"] >= 1 and stats["drafted"] >= stats["accepted"]
