"""Numba kernels (CPU) and their numba.cuda twins (kernels/cuda).

Importing this package points Numba's on-disk cache at a folder named by a hash of the kernel sources
(every .py here, and pykv/formats.py whose constants the kernels compile in). Numba keys a cached
function on its own file only, so an edit to, or an upgrade of, a module it inlines (tiles.py, simd.py,
blocks.py) would otherwise load stale machine code for matmul.py or attention.py without a word.
Folder: $NUMBA_CACHE_DIR (if set) or $PYKV_CACHE or ~/.cache/pykv, then numba/<hash>.

Processes share that folder (two `pykv run` at once, pytest-xdist workers, the compile helper of
pykv.warm), so its index files are read and written under a file lock (_locked below): Numba's own
save reads a function's index, picks a free data-file name, writes the index and then the data, with
nothing to stop another process doing the same in between; two processes saving two signatures of
one function could both pick `f-1.nbc`, leaving the index naming one signature and the file holding
the other's machine code, which a later process would load and call."""
import contextlib
import hashlib
import os

from numba.core import caching as _caching
from numba.core import config as _nconfig

try:
    import fcntl as _fcntl
except ImportError:         # not POSIX: Numba's unlocked behaviour
    _fcntl = None


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
    _lock_cache_files(path)


@contextlib.contextmanager
def folder_lock(folder: str, kind: str = "LOCK_SH"):
    """flock(2) `kind` on folder/.pykv.lock for the block (the OS releases it if the process dies); no
    lock where none can be taken (not POSIX, a read-only folder): as Numba would."""
    fd = None
    if _fcntl is not None:
        try:
            fd = os.open(os.path.join(folder, ".pykv.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            fd = None
    try:
        if fd is not None:
            _fcntl.flock(fd, getattr(_fcntl, kind))
        yield
    finally:
        if fd is not None:
            os.close(fd)        # releases the lock


def _locked(method, kind: str, root: str):
    """A Numba IndexDataCacheFile method (save / load) run under folder_lock(kind), for folders under root."""
    def run(self, *args):
        if not self._cache_path.startswith(root):
            return method(self, *args)
        with folder_lock(self._cache_path, kind):
            return method(self, *args)
    run.__name__, run.pykv_locked = method.__name__, True
    return run


def cache_locked() -> bool:
    """Whether processes sharing pykv's kernel cache folder take turns on its index files (see above)."""
    return _fcntl is not None and getattr(_caching.IndexDataCacheFile.save, "pykv_locked", False)


def _lock_cache_files(root: str) -> None:
    """Index + data saves exclusive, loads shared, in every cache folder under root (once per process)."""
    f = _caching.IndexDataCacheFile
    if not getattr(f.save, "pykv_locked", False):
        f.save = _locked(f.save, "LOCK_EX", root)
        f.load = _locked(f.load, "LOCK_SH", root)


_use_cache_dir()
