"""The Python standard library as a corpus: fixed train / validation / test splits by module.

A file belongs to the top-level module it documents: ``json/decoder.py`` and
``test/test_json/test_dump.py`` both belong to ``json``, so a held-out module's own
tests never leak into training.
"""
from __future__ import annotations

import random
import sysconfig
from pathlib import Path

TEST_MODULES = ("argparse", "bisect", "calendar", "csv", "difflib", "fractions",
                "heapq", "json", "pprint", "shlex", "statistics", "textwrap")
VALIDATION_MODULES = ("configparser", "dataclasses", "ftplib", "gettext", "ipaddress",
                      "optparse", "sched", "tabnanny", "wave", "zipapp")
SPLITS = ("train", "validation", "test")
EOS = "<|endoftext|>"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_of(relative: Path) -> str:
    """Top-level module a stdlib file belongs to (tests map to the module they test)."""
    parts = relative.parts
    if parts[0] == "test" and len(parts) > 1:
        name = parts[1].removesuffix(".py")
        if name.startswith("test_"):
            return name[len("test_"):]
    return parts[0].removesuffix(".py")


def split_of(relative: Path) -> str:
    module = module_of(relative)
    if module in TEST_MODULES:
        return "test"
    if module in VALIDATION_MODULES:
        return "validation"
    return "train"


def split_files(split: str) -> list[Path]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in ("site-packages", "__pycache__"):
            continue
        if split_of(relative) == split:
            files.append(path)
    return files


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def code_prompts(tokenizer, split: str = "test", count: int = 16, prompt_tokens: int = 96,
                 seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``prompt_tokens`` tokens, each ending at a line break of a file
    of ``split``, chosen deterministically by ``seed``."""
    rng = random.Random(seed)
    files = [f for f in split_files(split) if len(read_text(f)) > 4000]
    prompts = []
    while len(prompts) < count:
        text = read_text(rng.choice(files))
        cut = text.rfind("\n", 0, rng.randrange(2000, len(text) - 1000)) + 1
        ids = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_tokens:
            prompts.append(ids[-prompt_tokens:])
    return prompts
