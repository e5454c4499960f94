#!/usr/bin/env bash
# Prints the interpreter `make install` makes .venv from (`make PYTHON=...` overrides it).
#
# It must be a CPython 3.11 that can make a venv: the pinned CPU torch is a cp311 wheel. Among those on PATH, one
# whose executable holds the interpreter itself comes first; one that loads it from libpython3.11.so (a build with
# --enable-shared) second. On a 2-core AMD EPYC (AVX2) a statically linked one took 0.85x the CPU to import what a
# training rank imports and 0.86x for a whole GRPO test run: most of the suite is interpreters importing torch
# (docs/benchmarks.md, "Which interpreter").
set -u
fallback=""
for exe in $(type -ap python3.11 python3); do
    real=$("$exe" -c 'import sys, venv, ensurepip; print(sys.executable if sys.version_info[:2] == (3, 11) else "")' \
        2>/dev/null) || continue
    [ -n "$real" ] || continue
    fallback=${fallback:-$real}
    if ! ldd "$real" 2>/dev/null | grep -q 'libpython3'; then
        echo "$real"
        exit 0
    fi
done
echo "${fallback:-python3}"
