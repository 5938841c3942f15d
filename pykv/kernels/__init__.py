"""Numba kernels (CPU) and their numba.cuda twins (kernels/cuda).

Importing this package points Numba's on-disk cache at a folder named by a hash of the kernel sources
(every .py here, and pykv/formats.py whose constants the kernels compile in). Numba keys a cached
function on its own file only, so an edit to, or an upgrade of, a module it inlines (tiles.py, simd.py,
blocks.py) would otherwise load stale machine code for matmul.py or attention.py without a word.
Folder: $NUMBA_CACHE_DIR (if set) or $PYKV_CACHE or ~/.cache/pykv, then numba/<hash>."""
import hashlib
import os

from numba.core import config as _nconfig


def source_hash(here: str = "") -> str:
    """sha256 (16 hex digits) over the kernel sources' relative paths and bytes (here: this folder)."""
    here = here or os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(os.path.dirname(here), "formats.py")]
    for root, dirs, names in os.walk(here):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    h = hashlib.sha256()
    for p in files:
        h.update(os.path.relpath(p, here).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _use_cache_dir() -> None:
    base = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
        os.environ.get("PYKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pykv"), "numba")
    path = os.path.join(base, source_hash())
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:            # not writable: Numba's own choice (__pycache__ or its user cache)
        return
    _nconfig.CACHE_DIR = path


_use_cache_dir()
