import subprocess
import sys

import pytest

from app.cli import main


@pytest.mark.usefixtures("smol")  # the default model, converted once for the session (tests/conftest.py)
def test_generate_prints_the_completion(capsys: pytest.CaptureFixture[str]):
    # in this process: a `python -m app.cli` child would import torch and transformers again
    # (seconds of CPU); the module's entry point itself is run by the test below
    assert main(["generate", "What is the capital of France?", "--threads", "1"]) == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def test_bad_argument_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "Hi", "--top-p", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "error: top_p must be a finite number in (0, 1], got 2.0" in result.stderr
