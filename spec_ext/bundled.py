"""Where the bundled models (``stdlib-target``, ``stdlib-draft``, the head ``stdlib-head``, the DFlash
block drafter ``stdlib-dflash``) and the learned policies' predictors (``policies/*.safetensors``)
are found.

Looked up in this order: the folder named by the environment variable ``SPEC_EXT_MODELS``;
the copy installed with the package (``pip install .`` puts the repository's ``models/``
folder at ``spec_ext/_models``); the ``models/`` folder of a source checkout (editable
installs).
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "SPEC_EXT_MODELS"


def search_path() -> list[Path]:
    """The folders looked in, in order."""
    here = Path(__file__).resolve().parent
    places = [Path(os.environ[ENV])] if os.environ.get(ENV) else []
    return places + [here / "_models", here.parent / "models"]


def bundled_path(*parts: str) -> Path:
    """``parts`` joined under the first folder of :func:`search_path` that holds them;
    FileNotFoundError naming every place looked in when none does."""
    for folder in search_path():
        path = folder.joinpath(*parts)
        if path.exists():
            return path
    looked = ", ".join(str(folder.joinpath(*parts)) for folder in search_path())
    raise FileNotFoundError(f"{'/'.join(parts)} is not in the bundled models (looked in: {looked}); "
                            f"set {ENV} to a folder that holds it")
