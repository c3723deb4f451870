"""Command line: ``python -m spec_ext {generate,demo,backends}``.

  python -m spec_ext generate --target DIR --draft DIR --prompt "def f(" --policy auto
  python -m spec_ext demo          # the bundled pair: streamed completion + speed table
  python -m spec_ext backends      # which kernel backends this build can run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from spec_ext.bundled import ENV, bundled_path
from spec_ext.policies import POLICIES
DEMO_PROMPT = '''def median(data):
    """Return the median (middle value) of numeric data.

    When the number of data points is odd, return the middle data point.
    When the number of data points is even, the median is interpolated by
    taking the average of the two middle values.
    """
'''


DTYPES = ("auto", "float32", "bfloat16", "float16")


def load_pair(target_dir: Path, draft_dir: Path, dtype: str = "float32"):
    """dtype: a torch dtype name, or "auto": as stored (the bundled pair: bfloat16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    for path, role in ((target_dir, "--target"), (draft_dir, "--draft")):
        if not (Path(path) / "config.json").exists():
            raise SystemExit(f"{role}: no Hugging Face model folder at {path}")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
    return tokenizer, target, draft


def _streamer(tokenizer):
    from transformers import TextStreamer
    return TextStreamer(tokenizer, skip_prompt=False)


def cmd_generate(args) -> None:
    import spec_ext
    tokenizer, target, draft = load_pair(args.target, args.draft, args.dtype)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    out = spec_ext.generate(target, draft, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, policy=args.policy, seed=args.seed,
                            streamer=_streamer(tokenizer), fast_linear=args.fast_linear)
    print("\n" + json.dumps(out.stats.as_dict(), indent=2))


def _tokens_per_s(fn, repeats: int) -> tuple[float, object]:
    rates, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result, new_tokens = fn()
        rates.append(new_tokens / (time.perf_counter() - started))
    return statistics.median(rates), result


def cmd_demo(args) -> None:
    import spec_ext
    torch.set_num_threads(args.threads or torch.get_num_threads())
    tokenizer, target, draft = load_pair(args.target, args.draft, args.dtype)
    ids = tokenizer(DEMO_PROMPT, return_tensors="pt").input_ids
    n = args.max_new_tokens
    print(f"spec_ext demo: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params, "
          f"draft {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M params, {n} new tokens, greedy\n")
    spec_ext.generate(target, draft, ids, max_new_tokens=n, policy="auto", streamer=_streamer(tokenizer))
    print("\n")

    def alone():
        out = target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=tokenizer.eos_token_id)
        return out, out.shape[1] - ids.shape[1]

    rows = []
    base, reference = _tokens_per_s(alone, args.repeats)
    rows.append(("target alone (HF generate)", base, None))
    runs = [(policy, False) for policy in args.policies] + [("fixed", True)]
    for policy, fast_linear in runs:
        def run():
            out = spec_ext.generate(target, draft, ids, max_new_tokens=n, eos_token_id=[], policy=policy,
                                    fast_linear=fast_linear)
            return out, out.stats.new_tokens
        rate, out = _tokens_per_s(run, args.repeats)
        same = torch.equal(out.sequences[0], reference[0, :out.sequences.shape[1]])
        name = f"spec_ext {policy}{', fast_linear' if fast_linear else ''}"
        rows.append((f"{name}{'' if same else ' (OUTPUT DIFFERS)'}", rate, out.stats))
    print(f"{'':34} {'tokens/s':>9} {'speed-up':>9} {'accepted/call':>14} {'accept rate':>12} {'target calls':>13}")
    for name, rate, stats in rows:
        extra = ("", "", "") if stats is None else (f"{stats.mean_accepted:.2f}", f"{stats.acceptance_rate:.2f}",
                                                    str(stats.target_calls))
        print(f"{name:34} {rate:9.1f} {rate / base:8.2f}x {extra[0]:>14} {extra[1]:>12} {extra[2]:>13}")
    print(f"\n(medians of {args.repeats} runs; greedy output identical to the target's own unless marked;"
          " the draft runs on spec_ext's skinny-GEMM kernel; fast_linear: the target too)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spec_ext", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt with speculative decoding, streamed")
    gen.add_argument("--target", type=Path, required=True)
    gen.add_argument("--draft", type=Path, required=True)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--policy", default="auto", choices=sorted(POLICIES), help="default: %(default)s")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--dtype", default="float32", choices=DTYPES, help="auto: as stored")
    gen.add_argument("--fast-linear", action="store_true",
                     help="the target's linear layers through spec_ext's skinny GEMM too, as the draft's always "
                     "are (CPU float32; the target's logits are then not bit-equal to HF's)")
    demo = sub.add_parser("demo", help="the bundled pair: streamed completion and a speed table")
    demo.add_argument("--target", type=Path, help=f"default: the bundled stdlib-target (${ENV} to look elsewhere)")
    demo.add_argument("--draft", type=Path, help="default: the bundled stdlib-draft")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--repeats", type=int, default=3)
    demo.add_argument("--threads", type=int)
    demo.add_argument("--dtype", default="float32", choices=DTYPES,
                      help="auto: as stored (bfloat16; greedy output then depends on the attention kernel's rounding)")
    demo.add_argument("--policies", nargs="+", default=["auto", "fixed", "svip", "confidence", "tree"],
                      choices=sorted(POLICIES), metavar="POLICY", help="default: %(default)s")
    sub.add_parser("backends", help="which kernel backends this build can run, and why not")
    args = parser.parse_args(argv)
    if args.command == "generate":
        cmd_generate(args)
    elif args.command == "demo":
        try:
            args.target = args.target or bundled_path("stdlib-target")
            args.draft = args.draft or bundled_path("stdlib-draft")
        except FileNotFoundError as error:
            parser.error(str(error))
        cmd_demo(args)
    else:
        import spec_ext
        json.dump(spec_ext.backends(), sys.stdout, indent=2)
        print()


if __name__ == "__main__":
    main()
