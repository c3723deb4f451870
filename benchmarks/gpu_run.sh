#!/usr/bin/env bash
# One prepared run on a GPU machine (see the device notes of the project): build for the
# GPU's arch in a copy of the tree in the background, the AOT compile test and the Triton
# kernels' tests meanwhile, then the GPU tests and the kernel benchmarks with CUDA-graph GPU
# times. Everything lands in $RESULTS.
#   RESULTS=$OUT bash benchmarks/gpu_run.sh          (about 5 minutes on an H200)
set -u
START=$(date +%s); el() { echo "[$(( $(date +%s) - START ))s] $*"; }
RESULTS=${RESULTS:-/tmp/gpu_results}; mkdir -p "$RESULTS"
ARCH=${TORCH_CUDA_ARCH_LIST:-$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
rm -rf /tmp/spec_ext_build && cp -r . /tmp/spec_ext_build
ln -sfn ../kernels spec_ext/kernels && export PYTHONPATH=$PWD
( cd /tmp/spec_ext_build && TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=$(nproc) SPEC_EXT_CUDA=1 CUDA_HOME=/usr/local/cuda \
    timeout 300 python3 setup.py build_ext --inplace > "$RESULTS/build.log" 2>&1; echo "rc=$?" >> "$RESULTS/build.log" ) &
# first, while the build runs: every Triton kernel compiled AOT for sm_80/sm_90 (CPU only),
# then every Triton kernel family run on the GPU against the reference
env -u TRITON_INTERPRET timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_triton_compile.py \
    > "$RESULTS/pytest_triton_compile.log" 2>&1; el "AOT compile test rc=$?"; tail -3 "$RESULTS/pytest_triton_compile.log"
timeout 240 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests/test_triton_kernels.py tests/test_tree_attention.py \
    tests/test_rejection_sampling.py tests/test_kv_cache.py tests/test_tree.py -k "triton" \
    > "$RESULTS/pytest_triton.log" 2>&1; el "Triton kernel tests rc=$?"; tail -3 "$RESULTS/pytest_triton.log"
wait
el "build $(tail -1 "$RESULTS/build.log")"
cp /tmp/spec_ext_build/spec_ext/_C*.so /tmp/spec_ext_build/spec_ext/_build_info.json spec_ext/
python3 -m spec_ext backends | tee "$RESULTS/backends.json"
timeout 240 python3 -m pytest -q -rs -n 8 -p no:cacheprovider tests -k "cuda or triton or gpu or registry or sdpa" \
    > "$RESULTS/pytest_gpu.log" 2>&1; el "GPU tests rc=$?"; tail -5 "$RESULTS/pytest_gpu.log"
timeout 300 python3 benchmarks/bench_kernels.py --graphs --budget 1 --ops attention rejection tree kv \
    > "$RESULTS/bench.log" 2>&1; el "bench rc=$?"
cp benchmarks/results/kernels_*.csv benchmarks/results/kernels_*.png "$RESULTS/" 2>/dev/null
