#!/usr/bin/env bash
# Fills .whl/ (git-ignored: add "/.whl/" to .git/info/exclude) with the wheels the GPU
# machines lack, for Python 3.12 on x86-64 Linux, so that benchmarks/gpu_check.sh can
# install them there without a network: run this where pip reaches the package index,
# then carry .whl/ to the GPU machine with the checkout.
set -euo pipefail
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
    trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 cattrs==26.2.1 pytest-trio==0.8.0
ls .whl
