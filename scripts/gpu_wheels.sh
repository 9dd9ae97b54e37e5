#!/usr/bin/env bash
# Fetch the wheels scripts/gpu_check.sh installs on a GPU machine that has torch, transformers
# and cupy but no network: nixl with its CUDA 13 build and pydantic with its dependencies, for
# CPython 3.12 on x86-64, into .whl/ (git-ignored). Versions: what this project's venv holds.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
for pkg in nixl==1.5.1 nixl-cu13==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$pkg"
done
ls -l .whl
