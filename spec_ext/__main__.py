"""Command line: ``python -m spec_ext {generate,demo,backends,train-head,train-dflash}``.

  python -m spec_ext generate --target DIR --draft DIR --prompt "def f(" --policy auto
  python -m spec_ext generate --target DIR --prompt "..." --policy ngram   # drafts from the text, no draft
  python -m spec_ext generate --target DIR --draft mtp --prompt "..."      # the checkpoint's own MTP layers
  python -m spec_ext demo          # the bundled pair: streamed completion + speed table
  python -m spec_ext backends      # which kernel backends this build can run
  python -m spec_ext backends --explain   # ... and what backend="auto" picks per device and op, and why
  python -m spec_ext train-head --target DIR --out DIR --data DIR_OR_FILE ...   # an EAGLE-3 head for the target
  python -m spec_ext train-dflash --target DIR --out DIR --data DIR_OR_FILE ...   # a DFlash block drafter
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from spec_ext.bundled import ENV, bundled_path

# the registry's names (spec_ext.policies.POLICIES; a test keeps the two equal), here so that
# --help and argument errors come before torch and transformers load
POLICY_NAMES = ("adalength", "adaptive", "auto", "confidence", "dynamictree", "fixed", "heuristic", "learnedspecbranch",
                "ngram", "pearl", "plain", "specbranch", "specdecpp", "suffix", "svip", "tree")
DEMO_PROMPT = '''def median(data):
    """Return the median (middle value) of numeric data.

    When the number of data points is odd, return the middle data point.
    When the number of data points is even, the median is interpolated by
    taking the average of the two middle values.
    """
'''


DTYPES = ("auto", "float32", "bfloat16", "float16")
FAST_LINEAR = {"auto": "auto", "on": True, "off": False}  # --fast-linear -> generate(fast_linear=)


def load_pair(target_dir: Path, draft_dir: Path | None, dtype: str = "float32"):
    """dtype: a torch dtype name, or "auto": as stored (the bundled pair: bfloat16); no
    draft_dir: the draft is None."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    from spec_ext.drafters import load
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    draft = None if draft_dir is None else load(draft_dir, target)  # a causal LM or a feature head
    return tokenizer, target, draft


def _streamer(tokenizer):
    from transformers import TextStreamer
    return TextStreamer(tokenizer, skip_prompt=False)


def cmd_generate(args) -> None:
    text_only = args.policy in ("ngram", "suffix") or (args.suffix_cache and args.policy == "auto")
    if args.draft is None and not text_only:
        raise ValueError(f"--draft: required with --policy {args.policy} (only ngram and suffix draft without a draft "
                         f"model)")
    if len(args.prompt) > 1 and not args.suffix_cache:
        raise ValueError("--prompt: given more than once; only with --suffix-cache (the prompts run in order)")
    import spec_ext
    tokenizer, target, draft = load_pair(args.target, args.draft, args.dtype)
    cache = spec_ext.SuffixCache(budget=args.suffix_cache) if args.suffix_cache else None
    for prompt in args.prompt:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = spec_ext.generate(target, draft, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, policy=args.policy, seed=args.seed,
                                streamer=_streamer(tokenizer), fast_linear=FAST_LINEAR[args.fast_linear],
                                suffix_cache=cache)
        print("\n" + json.dumps(out.stats.as_dict(), indent=2))


def data_files(paths: list[Path], pattern: str, option: str = "--data") -> list[Path]:
    """The files named, and those under the directories named that match ``pattern``."""
    files = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob(pattern) if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{option}: {path} does not exist")
    if not files:
        raise ValueError(f"{option}: no files matching {pattern!r} under {', '.join(map(str, paths))}")
    return files


def cmd_train_head(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_ext.training.head import HeadTraining, train_head
    torch.set_num_threads(args.threads or torch.get_num_threads())
    files = data_files(args.data, args.glob)
    validation = data_files(args.validation_data, args.glob, "--validation-data") if args.validation_data else None
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    settings = HeadTraining(sequences=args.sequences, steps=args.steps, batch=args.batch, ttt=args.ttt, lr=args.lr,
                            draft_vocab=args.draft_vocab, layer_ids=tuple(args.layer_ids) if args.layer_ids else None,
                            prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    train_head(target, tokenizer, files, args.out, args.work or args.out / "work", settings, validation)
    print(f"saved the head at {args.out} (speculators layout: vLLM and SGLang serve it)")


def cmd_train_dflash(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_ext.models.dflash import load_dflash
    from spec_ext.training.dflash import DFlashTraining, train_dflash
    torch.set_num_threads(args.threads or torch.get_num_threads())
    files = data_files(args.data, args.glob)
    validation = data_files(args.validation_data, args.glob, "--validation-data") if args.validation_data else None
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    source = load_dflash(args.init_from) if args.init_from else None  # its shape by default
    layers = args.layers or (source.num_layers if source is not None else 1)
    block_size = args.block_size or (source.block_size if source is not None else 16)
    layer_ids = tuple(args.layer_ids) if args.layer_ids else source.config.layer_ids if source is not None else None
    draft_vocab = args.draft_vocab or (source.config.draft_vocab_size if source is not None and source.reduced
                                       else None)
    settings = DFlashTraining(sequences=args.sequences, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                              steps=args.steps, batch=args.batch, anchors=args.anchors, block_size=block_size,
                              layers=layers, gamma=args.gamma, loss=args.loss, lr=args.lr,
                              draft_vocab=draft_vocab, layer_ids=layer_ids,
                              init_from=str(args.init_from) if args.init_from else None)
    train_dflash(target, tokenizer, files, args.out, args.work or args.out / "work", settings, validation)
    print(f"saved the drafter at {args.out} (speculators dflash layout: spec_ext generate --draft {args.out})")


def _tokens_per_s(fn, repeats: int) -> tuple[float, object]:
    rates, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result, new_tokens = fn()
        rates.append(new_tokens / (time.perf_counter() - started))
    return statistics.median(rates), result


def cmd_demo(args) -> None:
    import torch

    import spec_ext
    torch.set_num_threads(args.threads or torch.get_num_threads())
    tokenizer, target, draft = load_pair(args.target, args.draft, args.dtype)
    if not hasattr(draft, "device"):
        raise ValueError(f"--draft: the demo compares policies of a draft model (the static tree among them); "
                         f"{args.draft} is a feature head: use python -m spec_ext generate --draft {args.draft}")
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
    runs = [(f"spec_ext {policy}", policy, draft, "auto") for policy in args.policies]
    runs += [("spec_ext fixed, HF's F.linear", "fixed", draft, False),
             ("spec_ext ngram, no draft model", "ngram", None, "auto")]  # drafts from the prompt and output
    for name, policy, drafter, fast_linear in runs:
        def run():
            out = spec_ext.generate(target, drafter, ids, max_new_tokens=n, eos_token_id=[], policy=policy,
                                    fast_linear=fast_linear)
            return out, out.stats.new_tokens
        rate, out = _tokens_per_s(run, args.repeats)
        same = torch.equal(out.sequences[0], reference[0, :out.sequences.shape[1]])
        rows.append((f"{name}{'' if same else ' (OUTPUT DIFFERS)'}", rate, out.stats))
    print(f"{'':34} {'tokens/s':>9} {'speed-up':>9} {'accepted/call':>14} {'accept rate':>12} {'target calls':>13}")
    for name, rate, stats in rows:
        extra = ("", "", "") if stats is None else (f"{stats.mean_accepted:.2f}", f"{stats.acceptance_rate:.2f}",
                                                    str(stats.target_calls))
        print(f"{name:34} {rate:9.1f} {rate / base:8.2f}x {extra[0]:>14} {extra[1]:>12} {extra[2]:>13}")
    kernel = "the skinny-GEMM kernel" if spec_ext.ops.linear.kernel_applies(draft.device, draft.dtype) else "F.linear"
    print(f"\n(medians of {args.repeats} runs; greedy output identical to the target's own unless marked;"
          f" the linear layers run on {kernel} where it is faster; HF's F.linear: the target's on HF's arithmetic;"
          f" ngram: drafts copied from"
          f" the prompt and output, verified like a draft model's)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _model_folder(text: str) -> Path:
    path = Path(text)
    if not (path / "config.json").exists():
        raise argparse.ArgumentTypeError(f"no Hugging Face model folder (config.json) at {path}")
    return path


def _draft_folder(text: str) -> Path:
    """A draft's folder, or ``mtp`` (the target checkpoint's own MTP layers)."""
    return Path(text) if text == "mtp" else _model_folder(text)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m spec_ext", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    defaults = argparse.ArgumentDefaultsHelpFormatter
    gen = sub.add_parser("generate", help="complete a prompt with speculative decoding, streamed",
                         formatter_class=defaults)
    gen.add_argument("--target", type=_model_folder, required=True, help="the target model's folder")
    gen.add_argument("--draft", type=_draft_folder,
                     help="the draft model's folder (same vocabulary) or an EAGLE-1/EAGLE-3 head's (speculators "
                     "or EAGLE layout), or mtp: the target checkpoint's own MTP layers; optional with --policy ngram, which then drafts from the prompt and output alone")
    gen.add_argument("--prompt", required=True, action="append",
                     help="the text to complete (repeat with --suffix-cache: the prompts run in order)")
    gen.add_argument("--suffix-cache", type=_positive, metavar="TOKENS",
                     help="suffix decoding: keep a SuffixCache of this many tokens across the prompts, each drafting "
                     "from the earlier ones' outputs (with --policy auto, ngram or suffix)")
    gen.add_argument("--policy", default="auto", choices=POLICY_NAMES, help="how the draft proposes each round")
    gen.add_argument("--max-new-tokens", type=_positive, default=128, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=_positive, help="sample from the k most likely tokens")
    gen.add_argument("--top-p", type=float, help="sample from the smallest set holding this much probability")
    gen.add_argument("--seed", type=int, help="makes a sampled run reproducible")
    gen.add_argument("--dtype", default="float32", choices=DTYPES, help="auto: as stored")
    gen.add_argument("--fast-linear", default="auto", choices=list(FAST_LINEAR),
                     help="the target's linear layers through spec_ext's skinny GEMM (CPU float32): auto where it "
                     "is faster, on everywhere it applies, off keeps HF's F.linear (the logits then bit-equal HF's)")
    demo = sub.add_parser("demo", help="the bundled pair: streamed completion and a speed table",
                          formatter_class=defaults)
    demo.add_argument("--target", type=_model_folder, help=f"default: the bundled stdlib-target (${ENV} to look "
                      "elsewhere)")
    demo.add_argument("--draft", type=_model_folder, help="default: the bundled stdlib-draft")
    demo.add_argument("--max-new-tokens", type=_positive, default=128, help="tokens to generate")
    demo.add_argument("--repeats", type=_positive, default=3, help="timed runs per method (the median is shown)")
    demo.add_argument("--threads", type=_positive, help="torch intra-op threads (default: torch's)")
    demo.add_argument("--dtype", default="float32", choices=DTYPES,
                      help="auto: as stored (bfloat16; greedy output then depends on the attention kernel's rounding)")
    demo.add_argument("--policies", nargs="+", default=["auto", "fixed", "svip", "confidence", "tree"],
                      choices=POLICY_NAMES, metavar="POLICY", help=f"any of {', '.join(POLICY_NAMES)}")
    backends = sub.add_parser("backends", help="which kernel backends this build can run, and why not")
    backends.add_argument("--explain", action="store_true",
                          help="also what backend='auto' picks on CPU and CUDA tensors for every op, and the "
                               "measurements behind it")
    head = sub.add_parser("train-head", help="train an EAGLE-3 head for a target on its own continuations",
                          formatter_class=defaults)
    head.add_argument("--target", type=_model_folder, required=True, help="the target model's folder")
    head.add_argument("--out", type=Path, required=True, help="where the head is saved (speculators layout)")
    head.add_argument("--data", type=Path, nargs="+", required=True,
                      help="text files, or directories of them, to cut prompts from")
    head.add_argument("--validation-data", type=Path, nargs="+",
                      help="held-out files for the printed agreement (default: --data, other prompts)")
    head.add_argument("--glob", default="*", help="which files of a --data directory to read")
    head.add_argument("--work", type=Path, help="cache and checkpoints, resumed on a rerun (default: OUT/work)")
    head.add_argument("--sequences", type=_positive, default=1024, help="on-policy training sequences")
    head.add_argument("--prompt-tokens", type=_positive, default=128, help="tokens of each prompt")
    head.add_argument("--new-tokens", type=_positive, default=128, help="tokens the target continues each with")
    head.add_argument("--steps", type=_positive, default=2000, help="optimiser steps")
    head.add_argument("--batch", type=_positive, default=8, help="sequences per step")
    head.add_argument("--ttt", type=_positive, default=3, help="training-time-test steps (the head unrolled)")
    head.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine to a tenth)")
    head.add_argument("--draft-vocab", type=_positive,
                      help="a draft vocabulary of this many most frequent tokens (default: the target's)")
    head.add_argument("--layer-ids", type=int, nargs="+", help="target layers to tap (default: 2, L//2, L-3)")
    head.add_argument("--threads", type=_positive, help="torch intra-op threads (default: torch's)")
    dflash = sub.add_parser("train-dflash", formatter_class=defaults,
                            help="train a DFlash block drafter for a target on its own continuations")
    dflash.add_argument("--target", type=_model_folder, required=True, help="the target model's folder")
    dflash.add_argument("--out", type=Path, required=True, help="where the drafter is saved (speculators layout)")
    dflash.add_argument("--data", type=Path, nargs="+", required=True,
                        help="text files, or directories of them, to cut prompts from")
    dflash.add_argument("--validation-data", type=Path, nargs="+",
                        help="held-out files for the printed agreement (default: --data, other prompts)")
    dflash.add_argument("--glob", default="*", help="which files of a --data directory to read")
    dflash.add_argument("--work", type=Path, help="cache and checkpoints, resumed on a rerun (default: OUT/work)")
    dflash.add_argument("--sequences", type=_positive, default=1024, help="on-policy training sequences")
    dflash.add_argument("--prompt-tokens", type=_positive, default=128, help="tokens of each prompt")
    dflash.add_argument("--new-tokens", type=_positive, default=128, help="tokens the target continues each with")
    dflash.add_argument("--steps", type=_positive, default=2000, help="optimiser steps")
    dflash.add_argument("--batch", type=_positive, default=8, help="sequences per step")
    dflash.add_argument("--anchors", type=_positive, default=32, help="random blocks per sequence per step")
    dflash.add_argument("--block-size", type=_positive,
                        help="slots per block (drafts: one fewer; default: 16, or that of --init-from)")
    dflash.add_argument("--layers", type=_positive,
                        help="the drafter's decoder layers (default: 1, or those of --init-from)")
    dflash.add_argument("--init-from", type=Path,
                        help="a drafter trained before to go on from (its mask token; its block size, layer ids and "
                             "draft vocabulary by default; layers past its own start as identities)")
    dflash.add_argument("--gamma", type=float, default=4.0, help="slot j's loss weight is exp(-(j-1)/gamma)")
    dflash.add_argument("--loss", choices=("ce", "kl"), default="ce",
                        help="ce: to the target's greedy tokens; kl: to its distributions")
    dflash.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine to a tenth)")
    dflash.add_argument("--draft-vocab", type=_positive,
                        help="a draft vocabulary of this many most frequent tokens (default: the target's, or that "
                             "of --init-from)")
    dflash.add_argument("--layer-ids", type=int, nargs="+",
                        help="target layers to tap (default: four from 2 to L-1, or those of --init-from)")
    dflash.add_argument("--threads", type=_positive, help="torch intra-op threads (default: torch's)")
    return top


def main(argv=None) -> None:
    cli = parser()
    args = cli.parse_args(argv)
    try:
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "demo":
            args.target = args.target or bundled_path("stdlib-target")
            args.draft = args.draft or bundled_path("stdlib-draft")
            cmd_demo(args)
        elif args.command == "train-head":
            cmd_train_head(args)
        elif args.command == "train-dflash":
            cmd_train_dflash(args)
        else:
            import spec_ext
            json.dump(spec_ext.backends(), sys.stdout, indent=2)
            print()
            if args.explain:
                for device in ("cpu", "cuda"):
                    for op in spec_ext.ops.OPS:
                        print(spec_ext.ops.explain(op, device))
    except (ValueError, FileNotFoundError) as error:  # bad input: one line, not a traceback
        cli.exit(2, f"{cli.prog} {args.command}: error: {error}\n")


if __name__ == "__main__":
    main()
