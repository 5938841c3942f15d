"""The shape of the package: imports only go down the layers (import-linter's contracts in
pyproject.toml), files stay small enough to read, and no docstring or comment holds a dated measurement
(figures live in docs/ under their date)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "pykv"
LINT = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")
MAX_LINES = 900


def _lint(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([LINT, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize("where,upward", [
    ("kernels/ops.py", "import pykv.decoder.model"),            # a kernel importing the decoder
    ("decoder/model.py", "from pykv.api import session"),       # the decoder importing sessions
    ("api/generate.py", "from pykv.cli import args"),           # the library importing the command line
    ("kernels/blocks.py", "import pykv.files.gguf_io"),         # a kernel importing the file reader
])
def test_an_upward_import_breaks_a_contract(tmp_path, where, upward):
    shutil.copytree(PKG, tmp_path / "pykv", ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _lint(tmp_path, tmp_path).returncode == 0       # the copy as it is: kept
    f = tmp_path / "pykv" / where
    f.write_text(f.read_text() + f"\n{upward}  # noqa\n")
    r = _lint(tmp_path, tmp_path)
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout


def test_files_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py")
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not big, big


def test_no_dated_measurements_in_the_code():
    pat = re.compile(r"20\d\d-\d\d-\d\d|\bZen\b|Xeon|EPYC|Sapphire Rapids|Alder Lake")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in PKG.rglob("*.py")
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pat.search(line)]
    assert not hits, hits


def test_old_module_paths_still_import_with_a_warning():
    code = ("import warnings, importlib; warnings.simplefilter('error')\n"
            "import pykv\n"
            "try:\n    import pykv.kv_cache\nexcept DeprecationWarning as e:\n    print('warned', e)\n"
            "warnings.simplefilter('ignore')\n"
            "import pykv.kv_cache as old, pykv.kv.cache as new, pykv.convert as conv\n"
            "print(old is new, conv.quantize_gguf.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "warned pykv.kv_cache is deprecated: import pykv.kv.cache" in r.stdout
    assert "True pykv.tools.quantize" in r.stdout
