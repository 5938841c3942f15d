"""Hostile model files: the bounded fuzz run CI does (tools/fuzz.py), and every input that ever failed
one (tests/data/fuzz/) replayed for a clean PykvError."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FUZZ_DIR = Path(__file__).parents[1] / "data" / "fuzz"
CASES = sorted(p for p in FUZZ_DIR.iterdir() if p.suffix != ".md")   # TARGET-NAME.ext
N_CI = int(os.environ.get("PYKV_FUZZ_N", "2000"))    # tools/fuzz.py --n 10000 is the full run


def _fuzz_module():
    """tools/fuzz.py, imported as `fuzz` from tools/ on sys.path (the workers it spawns import it so)."""
    tools = str(ROOT / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module("fuzz")


@pytest.fixture(scope="module")
def fuzz():
    return _fuzz_module()


def test_bounded_gguf_fuzz(fuzz, tmp_path):
    """2,000 mutated tiny models (seed 1: other cases than the full run's seed 0): no crash, hang,
    foreign exception or oversized allocation; most of them refused with pykv's own error."""
    res = fuzz.fuzz("gguf", N_CI, seed=1, jobs=2, timeout=60.0, save=tmp_path, verbose=False)
    assert res["cases"] == N_CI
    bad = {k: res[k] for k in ("crash", "hang", "foreign", "alloc")}
    assert bad == {"crash": 0, "hang": 0, "foreign": 0, "alloc": 0}, res["failures"][:5]
    assert res["clean"] > N_CI // 2      # the mutations reach the checks (not all silently valid)


def test_bounded_state_fuzz(fuzz, tmp_path):
    """Mutated session state files (header fields, checksums repaired so the cases get past them,
    truncations, flipped bytes): Session.load refuses each cleanly or loads a consistent state."""
    n = max(50, N_CI // 8)
    res = fuzz.fuzz("state", n, seed=1, jobs=2, timeout=60.0, save=tmp_path, verbose=False)
    assert res["cases"] == n
    bad = {k: res[k] for k in ("crash", "hang", "foreign", "alloc")}
    assert bad == {"crash": 0, "hang": 0, "foreign": 0, "alloc": 0}, res["failures"][:5]
    assert res["clean"] > 0


@pytest.mark.parametrize("path", CASES, ids=[p.name for p in CASES])
def test_fuzz_regressions(fuzz, path):
    """An input that once crashed, hung or raised a foreign exception now fails cleanly."""
    status, detail = fuzz.replay(path.name.split("-")[0], str(path), None)
    if status == "skipped":
        pytest.skip(detail)
    assert status == "clean", detail


@pytest.mark.parametrize("name", ["http"])
def test_future_targets_skip_cleanly(fuzz, name, tmp_path):
    """Targets whose module does not exist yet say so instead of failing."""
    mod = {"state": "pykv.api.session", "http": None}[name]
    if mod and importlib.util.find_spec(mod) is not None:
        pytest.skip(f"{mod} exists: the target runs")
    res = fuzz.fuzz(name, 5, save=tmp_path, verbose=False)
    assert "skipped" in res and "yet" in res["skipped"]
