#!/usr/bin/env bash
# Pack what liger-cute-kernels 0.8.5's native fused linear cross-entropy loads on a Hopper GPU into
# .lck/site.tar.xz (about 49 MB, one transfer to the GPU machine): its package without the Blackwell
# core and the MoE cubin, TVM FFI, NVSHMEM's host library and UID bootstrap (cu12: the core links
# CUDA 12's runtime) and CUDA 12's libcudart, the libraries beside the core, where its loader looks
# first. scripts/gpu_liger_cute_kernels.py says how to run it there.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/wheels" \
  liger-cute-kernels==0.8.5 apache-tvm-ffi nvidia-nvshmem-cu12==3.6.5 nvidia-cuda-runtime-cu12
site=$work/site
mkdir -p "$site"
cd "$site"
unzip -q "$work"/wheels/liger_cute_kernels-*.whl -x 'liger_cute_kernels/liger_moe_*' 'liger_cute_kernels/*sm100f.so'
unzip -q "$work"/wheels/apache_tvm_ffi-*.whl
unzip -q -j "$work"/wheels/nvidia_nvshmem_cu12-*.whl 'nvidia/nvshmem/lib/libnvshmem_host.so.3' \
  'nvidia/nvshmem/lib/nvshmem_bootstrap_uid.so.3' -d liger_cute_kernels/
unzip -q -j "$work"/wheels/nvidia_cuda_runtime_cu12-*.whl 'nvidia/cuda_runtime/lib/libcudart.so.12' -d liger_cute_kernels/
mkdir -p "$root/.lck"
grep -qxF "/.lck/" "$root/.git/info/exclude" 2>/dev/null || echo "/.lck/" >> "$root/.git/info/exclude"
tar -cf - . | xz -6 -T0 > "$root/.lck/site.tar.xz"
ls -la "$root/.lck/site.tar.xz"
