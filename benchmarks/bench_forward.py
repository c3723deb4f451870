"""One decode forward of the bundled target and draft (and of random-weight Qwen3- and
Gemma-2-shaped models, a few layers each), three ways, side by side:

* ``hf``: the model's own forward with its own cache (DynamicCache, its default attention),
  as HF generate runs it;
* ``hf+spec_ext``: the HF modules over a SpecCache with spec_ext's tree attention
  (spec_ext.models.forward(use_lean=False), the path of models spec_ext.models.lean does not know);
* ``lean``: spec_ext.models.lean, the same arithmetic without the HF module machinery
  (the bundled Llama pair and Qwen3; Gemma-2 has no lean forward: empty there).

Median milliseconds over --repeats calls after a warm-up, for T new tokens per row over a
prefix of --prefix tokens; ratios against ``hf`` measured in the same run. Writes
benchmarks/results/lean_forward_cpu.csv.

    python benchmarks/bench_forward.py [--repeats 100] [--prefix 128] [--dtypes bfloat16 float32]
        [--models draft target qwen3 gemma2]
"""
from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, DynamicCache, Gemma2Config, Gemma2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from spec_ext.models import hf
from spec_ext.models import SpecCache
from spec_ext.models.lean import lean_decoder

ROOT = Path(__file__).resolve().parents[1]


def median_ms(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def costs(model, batch: int, width: int, prefix: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    head = torch.randint(0, model.config.vocab_size, (batch, prefix), generator=g)
    new = torch.randint(0, model.config.vocab_size, (batch, width), generator=g)
    results = {}

    cache = DynamicCache(config=model.config)
    model(head, cache=cache, use_cache=True)

    def hf_step():
        model(new, cache=cache, use_cache=True)
        cache.crop(-width)  # drop the new tokens again

    results["hf"] = median_ms(hf_step, repeats)
    for name, lean in (("hf+spec_ext", False), ("lean", True)):
        spec = SpecCache.for_model(model, batch, prefix + width + 1)
        with hf.attention_implementation(model):
            if lean and lean_decoder(model) is None:
                continue
            hf.forward(model, head, spec, torch.arange(prefix).expand(batch, prefix), use_lean=lean)
            spec.advance([prefix] * batch)
            positions = spec.lengths[:, None] + torch.arange(width)
            results[name] = median_ms(lambda: hf.forward(model, new, spec, positions, use_lean=lean), repeats)
    return results


# layers shaped like Qwen3-0.6B's and Gemma-2-2B's (Gemma-2: its soft-caps and a sliding
# window on every other layer), 4 and 2 of them, with a 32768-row vocabulary
SHAPED = {
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(
        vocab_size=32768, hidden_size=2304, intermediate_size=9216, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, sliding_window=4096)),
}


def load(name: str, dtype: torch.dtype):
    if name in SHAPED:
        torch.manual_seed(0)
        return SHAPED[name]().to(dtype).eval()
    return AutoModelForCausalLM.from_pretrained(ROOT / "models" / f"stdlib-{name}", dtype=dtype).eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--models", nargs="+", default=["draft", "target", *SHAPED],
                        choices=["draft", "target", *SHAPED])
    args = parser.parse_args()
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    rows = []
    print(f"{'model':7} {'dtype':9} {'B':>2} {'T':>2} {'hf ms':>7} {'hf+spec_ext':>12} {'lean':>7} {'hf/lean':>8} "
          f"{'hf/hf+spec_ext':>15}")
    with torch.inference_mode():
        for dtype in args.dtypes:
            for name in args.models:
                model = load(name, getattr(torch, dtype))
                for batch, width in ((1, 1), (1, 4), (8, 1), (8, 4)):
                    r = costs(model, batch, width, args.prefix, args.repeats)
                    lean = r.get("lean")
                    rows.append(dict(model=name, dtype=dtype, batch=batch, new_tokens=width, prefix=args.prefix,
                                     hf_ms=round(r["hf"], 3), hf_spec_ext_ms=round(r["hf+spec_ext"], 3),
                                     lean_ms="" if lean is None else round(lean, 3),
                                     hf_over_lean="" if lean is None else round(r["hf"] / lean, 2),
                                     hf_over_hf_spec_ext=round(r["hf"] / r["hf+spec_ext"], 2),
                                     device=f"cpu-{torch.get_num_threads()}threads", commit=commit))
                    lean_text = "-" if lean is None else f"{lean:.2f}"
                    ratio = "-" if lean is None else f"{r['hf'] / lean:.2f}x"
                    print(f"{name:7} {dtype:9} {batch:2} {width:2} {r['hf']:7.2f} {r['hf+spec_ext']:12.2f} "
                          f"{lean_text:>7} {ratio:>8} {r['hf'] / r['hf+spec_ext']:14.2f}x")
    out = ROOT / "benchmarks" / "results" / "lean_forward_cpu.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
