"""Numba kernels (CPU) and their numba.cuda twins (kernels/cuda).

Importing this package points Numba's on-disk cache at a folder named by a hash of the kernel sources
(every .py here, and pykv/files/formats.py whose constants the kernels compile in). Numba keys a cached
function on its own file only, so an edit to, or an upgrade of, a module it inlines (tiles.py, simd.py,
blocks.py) would otherwise load stale machine code for matmul.py or attention.py without a word.
Folder: $NUMBA_CACHE_DIR (if set) or $PYKV_CACHE or ~/.cache/pykv, then numba/<hash>.

Processes share that folder (two `pykv run` at once, pytest-xdist workers, pykv.tools.warm's compile
helper), so its index files are read and written under a file lock (_locked below): Numba's own save
picks a free data-file name, then writes index and data, with nothing to stop another process doing the
same in between: two could both pick `f-1.nbc`, leaving an index that names one signature over the
other's machine code, which a later process would load and call.

They also take turns on compiling (_claiming below): a process about to compile or load a signature of
a cached kernel first claims it (a POSIX record lock on one byte of the folder's .pykv.claims, at a
hash of the function and signature), so a process that needs a kernel another is compiling waits for it
and loads the saved code instead of compiling the same thing twice at once."""
import contextlib
import errno
import hashlib
import os
import time

from llvmlite import binding as _ll
from numba.core import caching as _caching
from numba.core import codegen as _codegen
from numba.core import config as _nconfig
from numba.core import dispatcher as _dispatcher
from numba.core import sigutils as _sigutils

try:
    import fcntl as _fcntl
except ImportError:         # not POSIX: Numba's unlocked behaviour
    _fcntl = None


def source_hash(here: str = "") -> str:
    """sha256 (16 hex digits) over the kernel sources' relative paths and bytes (here: this folder)."""
    here = here or os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(os.path.dirname(here), "files", "formats.py")]
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


CLAIM_WAIT_S = 120.0    # the longest a compile waits for another process's claim (then it compiles anyway: a
#                         duplicate at worst; well above the longest claim, attend with its nested compiles)


@contextlib.contextmanager
def _claim(fd: int, off: int):
    """Byte off of the claims file fd locked (F_SETLK, polled: a holder that stops does not stop us past
    CLAIM_WAIT_S) for the block; no lock where none can be taken.  A wait is compile time for
    kernels.jitnote (its note on stderr, and the tokens/s figures that exclude it)."""
    from pykv.kernels import jitnote
    got = False
    t0 = time.perf_counter()
    tries = 0
    while True:
        try:
            _fcntl.lockf(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB, 1, off)
            got = True
            break
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN) or time.perf_counter() > t0 + CLAIM_WAIT_S:
                break
        if tries == 0:
            jitnote.waiting()
        tries += 1
        time.sleep(0.01)
    if tries:
        jitnote.waited(time.perf_counter() - t0)
    try:
        yield
    finally:
        if got:
            _fcntl.lockf(fd, _fcntl.LOCK_UN, 1, off)


def _claiming(method, root: str, fd: int):
    """Dispatcher.compile (compile or load one signature) under that signature's claim, for cached
    kernels under root.  Held during the nested compiles of its callees too: a non-recursive call graph
    cannot make two processes wait on each other (each waits only for a callee of what it holds)."""
    def compile(self, sig):
        cf = getattr(getattr(self, "_cache", None), "_cache_file", None)
        if cf is None or not getattr(cf, "_cache_path", "").startswith(root):
            return method(self, sig)
        args = tuple(_sigutils.normalize_signature(sig)[0])
        if args in self.overloads:
            return method(self, sig)
        key = f"{cf._index_name}\0{args!r}\0{self.targetctx.codegen().magic_tuple()!r}"
        off = int.from_bytes(hashlib.sha256(key.encode()).digest()[:5], "little")
        with _claim(fd, off):
            return method(self, sig)
    compile.__name__, compile.pykv_claiming = method.__name__, True
    return compile


def _lock_cache_files(root: str) -> None:
    """Index + data saves exclusive, loads shared, in every cache folder under root; compiles claimed
    (once per process)."""
    f = _caching.IndexDataCacheFile
    if not getattr(f.save, "pykv_locked", False):
        f.save = _locked(f.save, "LOCK_EX", root)
        f.load = _locked(f.load, "LOCK_SH", root)
    d = _dispatcher.Dispatcher
    if _fcntl is not None and not getattr(d.compile, "pykv_claiming", False):
        try:    # kept open for the process's life: closing any fd of the file drops its record locks
            fd = os.open(os.path.join(root, ".pykv.claims"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return
        d.compile = _claiming(d.compile, root, fd)


def _own_names(method):
    """CPUCodeLibrary.finalize, noting first the functions the library defines itself (before the
    callees' libraries are linked in)."""
    def run(self):
        self._pykv_own = {f.name for f in self._final_module.functions if not f.is_declaration}
        return method(self)
    run.__name__, run.pykv_internal = method.__name__, True
    return run


def _internalizing(method):
    """CPUCodeLibrary._optimize_final_module that first makes internal every function finalize has just
    linked in from the callees' libraries.  Numba links a copy of each callee into every caller and
    leaves the copies weak (linkonce_odr, or weak_odr for a parallel loop's wrapper) in the machine code,
    and the JIT binds every caller to the first definition of that name loaded in the process.  The
    copies are optimized with each caller (other inlining, other vectorized sums), so a caller ran
    whichever copy came first: the bits of a model's decode depended on which kernels the process had
    compiled or loaded before (cold against warm cache, other models in the process).  Internal, each
    caller runs the copy it was compiled with."""
    def run(self):
        own = getattr(self, "_pykv_own", None)
        if own is not None:
            for fn in self._final_module.functions:
                if not fn.is_declaration and fn.name not in own and fn.linkage != _ll.Linkage.internal:
                    fn.linkage = _ll.Linkage.internal
        return method(self)
    run.__name__, run.pykv_internal = method.__name__, True
    return run


def _internalize_linked_copies() -> None:
    lib = _codegen.CPUCodeLibrary
    if not getattr(lib.finalize, "pykv_internal", False):
        lib.finalize = _own_names(lib.finalize)
        lib._optimize_final_module = _internalizing(lib._optimize_final_module)


TUNING_PINNED = False     # whether _pin_vector_tuning set Numba's CPU features


def _pin_vector_tuning() -> None:
    """On AVX-512 hosts, compile without LLVM's prefer-256-bit tuning, which Intel CPU models carry
    (e.g. rocketlake) and AMD's do not: it changes the summation order of vectorised float loops, so
    one ISA class gave other bits, and other greedy tokens, on Intel hosts than on AMD ones, and a
    batched step stopped matching the single-sequence one there.  Only when the user set neither
    NUMBA_CPU_NAME nor NUMBA_CPU_FEATURES."""
    global TUNING_PINNED
    if _nconfig.CPU_NAME not in (None, "host") or _nconfig.CPU_FEATURES is not None:
        return
    try:
        f = _ll.get_host_cpu_features()
    except RuntimeError:      # pragma: no cover - llvmlite without host feature detection
        return
    if f.get("avx512f"):
        _nconfig.CPU_FEATURES = f.flatten() + ",-prefer-256-bit"
        TUNING_PINNED = True


_internalize_linked_copies()
_pin_vector_tuning()
_use_cache_dir()
