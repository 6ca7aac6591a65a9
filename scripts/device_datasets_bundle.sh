#!/usr/bin/env bash
# Packs Hugging Face `datasets` and what it needs (pyarrow, pandas, xxhash, multiprocess) for the
# lent GPU machine, which has none of them, into .device-ds/ds.tar.xz (about 30 MB). nemo-automodel's
# train_ft imports `datasets` and packs THD rows with it.
#
# It travels apart from the main device bundle (.device/, about 56 MB) because one call carries
# 64 MiB at most: carry .device first, then, on the still-warm machine, carry .device-ds and unpack
# it under a path containing "site-packages" (dill pickles modules found elsewhere by value, and
# `datasets` then fails in Dataset.from_dict):
#   mkdir -p /tmp/dsa-ds/site-packages && tar -C /tmp/dsa-ds/site-packages -xJf .device-ds/ds.tar.xz
#   export PYTHONPATH="$PWD:/tmp/dsa-ds/site-packages:/tmp/dsa-site"
# Versions are the local venv's, for CPython 3.12 (the GPU machine's Python).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
venv_version() { "$root/.venv/bin/pip" list --format=freeze | grep -i "^$1==" | cut -d= -f3; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
grep -qx '/.device-ds/' "$root/.git/info/exclude" 2>/dev/null || echo '/.device-ds/' >> "$root/.git/info/exclude"
requirements=()
for name in datasets pyarrow pandas xxhash multiprocess python-dateutil; do
  requirements+=("$name==$(venv_version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$work/wheels" "${requirements[@]}" six
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
# What train_ft never loads: Flight, S3, the C++ headers and sources, the test suites, and the
# copies of libarrow_python that unzip makes of its symlinks (pyarrow itself needs substrait).
cd "$work/site/pyarrow"
rm -rf libarrow_flight* _flight* libarrow_python_flight* libarrow_s3* _pyarrow_cpp_tests* tests include src \
  includes ./*.pyx ./*.pxd libarrow_python.so libarrow_python.so.*.*.*
for link in libarrow_python.so.*; do
  ln -s "$link" libarrow_python.so
  break
done
rm -rf "$work/site/pandas/tests"
mkdir -p "$root/.device-ds"
tar -C "$work/site" -cf - . | xz -T0 -6 > "$root/.device-ds/ds.tar.xz"
ls -la "$root/.device-ds"
