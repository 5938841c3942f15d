"""Helpers shared by the CLI-level tests."""
import subprocess
import sys

EXIT_USAGE = 2          # pykv.cli.EXIT_USAGE (and argparse's): every user error


def run_module(module, *args, timeout=600, env=None):
    """python -m MODULE ARGS, no stdin, output captured."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env=env)


NOTES = ("pykv: compiling kernels", "pykv: fetching ", "pykv: loading ")   # progress notes, not errors


def error_lines(stderr: str) -> list[str]:
    """stderr's non-empty lines less pykv's progress notes (a cold kernel cache's compile note, a model
    fetch or load note)."""
    return [l for l in stderr.strip().splitlines() if l.strip() and not l.startswith(NOTES)]


def assert_clean_error(r, fragment, code=EXIT_USAGE):
    """Exit code `code`, one line on stderr containing `fragment` (besides progress notes), no traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = error_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert fragment.lower() in lines[0].lower(), lines[0]
