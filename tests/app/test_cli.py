import subprocess
import sys


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_the_completion():
    result = _cli("generate", "What is the capital of France?", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "The capital of France is Paris.\n"


def test_bad_argument_is_a_clear_error():
    result = _cli("generate", "Hi", "--top-p", "2", "--threads", "1")
    assert result.returncode == 2
    assert "error: top_p must be a finite number in (0, 1], got 2.0" in result.stderr
