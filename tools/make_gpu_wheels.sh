#!/usr/bin/env bash
# Build the wheel folder a bare GPU machine needs (see tools/gpu-wheels.txt), on a machine that reaches PyPI.
#   tools/make_gpu_wheels.sh [DIR]        (default DIR: .whl, which git ignores)
# The GPU machine has CPython 3.12 on x86-64 Linux with torch, CUDA and transformers already installed, so
# every wheel is fetched for that platform with --no-deps (torch itself must never be pulled in), and
# DeepSpeed, published as a source archive only, is built into a pure-Python wheel with no ops compiled
# (DS_BUILD_OPS=0: ZeRO-3 training in dtlab uses torch.optim.AdamW and needs none of DeepSpeed's kernels).
# The build runs in pip's isolated build environment (setuptools and wheel fetched for it), so it works on a
# clean pip cache; DeepSpeed's setup.py finds no torch there and compiles nothing, which is what is wanted.
# The folder must stay under 40 MiB: it travels with the working tree (64 MiB in all); the check below says so.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-.whl}"
mkdir -p "$dir"
reqs=$(grep -v '^\s*#' "$here/gpu-wheels.txt" | grep -v '^\s*$' | grep -v '^deepspeed==')
ds=$(grep '^deepspeed==' "$here/gpu-wheels.txt")
plat=()
for n in 17 24 27 28 31 34; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
# shellcheck disable=SC2086
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$dir" $reqs
DS_BUILD_OPS=0 python3 -m pip wheel --no-deps -w "$dir" "$ds"
echo "wheel folder $dir: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
python3 "$here/gpu_runbook.py" check-wheels --wheels "$dir"
