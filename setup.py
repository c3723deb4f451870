"""Build spec_ext._C: C++ CPU kernels always, CUDA kernels whenever torch is a CUDA build
and a CUDA toolkit is found (GPU or not).

Environment:
  SPEC_EXT_CUDA=auto|0|1   build the CUDA kernels: when possible (default), never, always
  TORCH_CUDA_ARCH_LIST     CUDA archs; default "8.0;9.0" when no GPU is visible
  MAX_JOBS                 parallel compile jobs (ninja)
  CUDA_HOME                CUDA toolkit; defaults to /usr/local/cuda when it holds nvcc
"""
import glob
import json
import os
from pathlib import Path

from setuptools import find_packages, setup

if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
    # torch would otherwise infer the toolkit from nvcc's path (/usr/local) and miss cudart
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = Path(__file__).resolve().parent


def build_cuda() -> bool:
    choice = os.environ.get("SPEC_EXT_CUDA", "auto").lower()
    if choice not in ("auto", "0", "1"):
        raise SystemExit(f"SPEC_EXT_CUDA must be auto, 0 or 1, got {choice!r}")
    possible = torch.version.cuda is not None and CUDA_HOME is not None
    if choice == "1" and not possible:
        raise SystemExit(f"SPEC_EXT_CUDA=1 but torch.version.cuda={torch.version.cuda} and CUDA_HOME={CUDA_HOME}")
    return possible if choice == "auto" else choice == "1"


def cuda_include_dirs() -> list[str]:
    # headers shipped by the pip CUDA packages (cusparse.h is not in every local toolkit)
    try:
        import nvidia
    except ImportError:
        return []
    return [str(p) for base in nvidia.__path__ for p in Path(base).glob("cu*/include")]


def write_build_info(cuda: bool) -> None:
    # read by tests/test_registry.py: which dispatch keys this build must have registered
    info = {"cuda": cuda, "torch": torch.__version__, "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    (ROOT / "spec_ext" / "_build_info.json").write_text(json.dumps(info) + "\n")


def extension():
    sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3"]
    cuda = build_cuda()
    if cuda and not torch.cuda.is_available():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    write_build_info(cuda)
    if not cuda:
        print("spec_ext: building the CPU kernels only")
        return CppExtension("spec_ext._C", sources, extra_compile_args={"cxx": cxx + ["-fopenmp"]},
                            extra_link_args=["-fopenmp"], py_limited_api=False)
    print(f"spec_ext: building CPU and CUDA kernels for TORCH_CUDA_ARCH_LIST="
          f"{os.environ.get('TORCH_CUDA_ARCH_LIST', '(visible GPUs)')} with {CUDA_HOME}")
    return CUDAExtension(
        "spec_ext._C", sources + sorted(glob.glob("csrc/cuda/*.cu")),
        include_dirs=cuda_include_dirs(),
        extra_compile_args={"cxx": cxx + ["-fopenmp"], "nvcc": ["-O3", "--use_fast_math",
                                                               "-lineinfo", "--expt-relaxed-constexpr"]},
        extra_link_args=["-fopenmp"])


setup(
    # models/ (the bundled pair and the policies' predictors) installs as spec_ext/_models, where
    # spec_ext.bundled finds it in a non-editable install
    # (models/policies is named as a package of its own: a folder with an importable name is one)
    packages=find_packages(include=["spec_ext", "spec_ext.*"]) + ["spec_ext._models", "spec_ext._models.policies"],
    package_dir={"spec_ext": "spec_ext", "spec_ext._models": "models"},
    package_data={"spec_ext": ["_build_info.json"],
                  "spec_ext._models": ["*.json", "*/*.json", "*/*.safetensors", "*/*/*.json", "*/*/*.safetensors"],
                  "spec_ext._models.policies": ["*.json", "*.safetensors"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
