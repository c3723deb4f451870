"""The Python standard library as a corpus: fixed train / validation / test splits by module.

A file belongs to the top-level module it documents: ``json/decoder.py`` and
``test/test_json/test_dump.py`` both belong to ``json``, so a held-out module's own
tests never leak into training.
"""
from __future__ import annotations

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


def thirdparty_files() -> list[Path]:
    """Sources the bundled pair never saw: the click and jinja2 packages installed beside
    torch (read from this environment, nothing downloaded)."""
    import importlib.util
    files = []
    for package in ("click", "jinja2"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"the thirdparty workload reads the installed {package} package; it is not installed")
        files += sorted(Path(spec.submodule_search_locations[0]).rglob("*.py"))
    return files


def code_prompts(tokenizer, split: str = "test", count: int = 16, prompt_tokens: int = 96,
                 seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``prompt_tokens`` tokens, each ending at a line break of a file
    of ``split`` (or of :func:`thirdparty_files` for ``"thirdparty"``), chosen
    deterministically by ``seed``."""
    from spec_ext.training.corpus import prompts_from_files
    files = thirdparty_files() if split == "thirdparty" else split_files(split)
    return prompts_from_files(tokenizer, files, count, prompt_tokens, seed)
