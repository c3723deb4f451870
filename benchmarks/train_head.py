"""Train the bundled EAGLE-3 head (models/stdlib-head) for the bundled target, with
spec_ext.training.head on the target's own continuations of prompts from the standard
library's training split (held-out agreement on the validation split). Data, features and
checkpoints live under --work: a rerun resumes.

    python benchmarks/train_head.py            # the bundled head's settings
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_data import split_files  # noqa: E402

from spec_ext.training.head import HeadTraining, train_head  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main():
    defaults = HeadTraining(sequences=4096, steps=2400, draft_vocab=2048)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "stdlib-head")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".train_work" / "head")
    parser.add_argument("--sequences", type=int, default=defaults.sequences)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--ttt", type=int, default=defaults.ttt)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target.config._name_or_path = args.target.name  # the head's speculators_config.verifier, not this machine's path
    settings = HeadTraining(sequences=args.sequences, steps=args.steps, batch=args.batch, ttt=args.ttt, lr=args.lr,
                            draft_vocab=args.draft_vocab)
    started = time.perf_counter()
    train_head(target, tokenizer, split_files("train"), args.out, args.work, settings, split_files("validation"))
    print(f"{time.perf_counter() - started:.0f} s; the head is at {args.out}")


if __name__ == "__main__":
    main()
