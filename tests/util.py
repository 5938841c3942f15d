"""Helpers shared by the CLI-level tests."""
import subprocess
import sys


def run_module(module, *args, timeout=600):
    """python -m MODULE ARGS, no stdin, output captured."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_clean_error(r, fragment):
    """Non-zero exit, one line on stderr containing `fragment`, no traceback."""
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert fragment.lower() in lines[0].lower(), lines[0]
