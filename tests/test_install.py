"""A non-editable install (``pip install .``) into a fresh folder runs from anywhere: the
package, its Triton kernels and the bundled models and predictors come with it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "*.so", "_build_info.json", "__pycache__",
                              ".pytest_cache", ".hypothesis", ".train_work", "results")


@pytest.mark.slow
def test_a_non_editable_install_runs_the_demo_from_another_folder(tmp_path):
    source, site, elsewhere = tmp_path / "source", tmp_path / "site", tmp_path / "elsewhere"
    shutil.copytree(ROOT, source, ignore=SKIP)  # builds write into the tree: keep the checkout's own build
    elsewhere.mkdir()
    env = {**os.environ, "SPEC_EXT_CUDA": "0", "PYTHONPATH": str(site)}
    env.pop("SPEC_EXT_MODELS", None)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "--target",
                    str(site), str(source)], check=True, cwd=elsewhere, env={**env, "PYTHONPATH": ""})
    shutil.rmtree(source)  # nothing may still point into the source tree
    check = ("import spec_ext, spec_ext.kernels, spec_ext.bundled as b, spec_ext.policies as p; "
             f"assert spec_ext.__file__.startswith({str(site)!r}), spec_ext.__file__; "
             f"assert str(b.bundled_path('stdlib-target')).startswith({str(site)!r}); "
             f"assert str(b.bundled_path('stdlib-head', 'model.safetensors')).startswith({str(site)!r}); "
             "p.SpecDecPP(); p.AdaLength(); p.LearnedSpecBranch(); print(spec_ext.backends()['cpu'])")
    out = subprocess.run([sys.executable, "-c", check], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "available"
    demo = subprocess.run([sys.executable, "-m", "spec_ext", "demo", "--max-new-tokens", "8", "--repeats", "1",
                           "--policies", "fixed"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert demo.returncode == 0, demo.stderr
    assert "OUTPUT DIFFERS" not in demo.stdout and "spec_ext fixed" in demo.stdout


def test_the_bundle_is_looked_up_where_the_environment_says_and_a_miss_names_every_place(tmp_path, monkeypatch):
    from spec_ext import bundled
    monkeypatch.setenv("SPEC_EXT_MODELS", str(tmp_path))
    (tmp_path / "policies").mkdir()
    assert bundled.bundled_path("policies") == tmp_path / "policies"
    with pytest.raises(FileNotFoundError, match=f"looked in: {tmp_path / 'nothing'}, .*set SPEC_EXT_MODELS"):
        bundled.bundled_path("nothing")
