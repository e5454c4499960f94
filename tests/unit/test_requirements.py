"""The two pinned stacks agree, the GPU install paths use its pins, and this environment is the CPU stack it pins."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from openppo.utils.pins import installed_mismatches, read_pins
from tests.conftest import REPO

CPU, GPU = REPO / "requirements" / "cpu.txt", REPO / "requirements" / "gpu.txt"


def test_the_cpu_and_gpu_stacks_pin_every_shared_package_alike():
    cpu, gpu = read_pins(CPU), read_pins(GPU)
    shared = sorted(set(cpu) & set(gpu))
    assert {"torch", "vllm", "transformers", "deepspeed", "ray", "peft", "datasets"} <= set(shared), shared
    differ = {name: (cpu[name], gpu[name]) for name in shared if cpu[name] != gpu[name]}
    assert not differ, f"pinned differently (cpu, gpu): {differ}"
    # the GPU stack pins its own packages exactly, as the CPU stack does: only logging/UI tools float on both
    floating = {name for name, spec in gpu.items() if not spec.startswith("==")}
    assert floating <= {"accelerate", "tensorboard", "wandb", "tqdm"}, floating


def test_read_pins_follows_includes_and_names(tmp_path):
    (tmp_path / "base.txt").write_text("torch==2.13.0  # pinned\n")
    (tmp_path / "top.txt").write_text("# a comment\n-r base.txt\nRay[default]==2.60.0\nvllm_cpu==0.32.0\ntqdm\n-e .\n")
    assert read_pins(tmp_path / "top.txt") == {"torch": "==2.13.0", "ray": "==2.60.0", "vllm": "==0.32.0", "tqdm": ""}


def test_the_gpu_install_paths_use_the_pins():
    assert "-r requirements/gpu.txt" in (REPO / "requirements.txt").read_text().splitlines()
    dockerfile = (REPO / "dockerfile" / "Dockerfile").read_text()
    makefile = (REPO / "Makefile").read_text()
    for text in (dockerfile, makefile):  # torch and the build tools first, then the rest against them
        first, rest = text.index("-r requirements/gpu-build.txt"), text.index("-r requirements/gpu.txt")
        assert first < rest and "--no-build-isolation -r requirements/gpu.txt" in text
    assert "install-gpu:" in makefile and "hadolint dockerfile/Dockerfile" in makefile


def test_this_environment_is_the_pinned_cpu_stack():
    """`make install` gives what requirements/cpu.txt pins (torch's +cpu build tag aside)."""
    assert installed_mismatches(read_pins(CPU)) == {}


def _interpreters_311() -> dict[bool, Path]:
    """This box's CPython 3.11 executables by whether they load libpython from a shared library."""
    found: dict[bool, Path] = {}
    for line in subprocess.run(["bash", "-c", "type -ap python3.11"], capture_output=True, text=True).stdout.split():
        real = subprocess.run([line, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
        exe = Path(real.stdout.strip())
        if real.returncode == 0 and exe.is_file():
            found.setdefault("libpython3" in subprocess.run(["ldd", exe], capture_output=True, text=True).stdout, exe)
    return found


def test_the_venv_is_made_from_a_statically_linked_311_when_there_is_one(tmp_path):
    """tools/venv_python.sh picks a static CPython 3.11 even when a shared-library one comes first on PATH, and the
    shared one when it is the only 3.11."""
    found = _interpreters_311()
    if set(found) != {True, False}:
        pytest.skip(f"needs a shared-library and a static CPython 3.11 on PATH, found {found}")
    dirs = []
    for shared in (True, False):
        (folder := tmp_path / ("shared" if shared else "static")).mkdir()
        (folder / "python3.11").symlink_to(found[shared])
        dirs.append(str(folder))

    # the script's own tools, and no other python on PATH
    (tools := tmp_path / "tools").mkdir()
    for name in ("bash", "ldd", "grep"):
        (tools / name).symlink_to(shutil.which(name))

    def pick(*path: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PATH": os.pathsep.join((*path, str(tools)))}
        script = str(REPO / "tools" / "venv_python.sh")
        return subprocess.run([shutil.which("bash"), script], capture_output=True, text=True, env=env)

    assert Path(pick(*dirs).stdout.strip()).resolve() == found[False].resolve()
    assert Path(pick(dirs[0]).stdout.strip()).resolve() == found[True].resolve()
