"""A plain ``pip install .`` (not editable) ships every data file the packages read at run time:
the policies, the planner's calibrations, hardware and model shapes, the chat template, the trace."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import app.openai_protocol
import autoscaling.policy
import planner.costs
import planner.roofline
import planner.study

ROOT = Path(__file__).resolve().parents[1]
READ_AT_RUN_TIME = (
    autoscaling.policy.POLICY_DIR,
    planner.costs.CALIBRATION_DIR,
    planner.roofline.HARDWARE_DIR,
    planner.roofline.MODELS_DIR,
    app.openai_protocol._SHIPPED_TOOLS_TEMPLATE.parent,
    planner.study.TRACE.parent,
)


def test_every_data_file_read_at_run_time_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = []
    for folder in READ_AT_RUN_TIME:
        files = [f for f in folder.iterdir() if f.is_file()]
        assert files, folder
        for file in files:
            package, *inside = file.relative_to(ROOT).parts
            if not any(fnmatch.fnmatch("/".join(inside), glob) for glob in globs.get(package, ())):
                missing.append(str(file.relative_to(ROOT)))
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
