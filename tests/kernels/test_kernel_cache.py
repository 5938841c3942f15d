"""Numba's on-disk cache is keyed by every kernel source (pykv/kernels/__init__.py): an edit to a
module that other kernels inline (tiles.py) must move the cache, or stale machine code loads."""
import pickle
import shutil
from pathlib import Path

import numba

import pykv.kernels as K
from pykv.kernels import matmul, mm_raw


def test_cache_dir_is_the_source_hash():
    assert Path(numba.config.CACHE_DIR).name == K.source_hash()
    # a cached kernel of mm_raw.py is looked up under that folder, not in __pycache__
    disp = next(v for v in vars(mm_raw).values() if getattr(v, "_cache", None) is not None
                and type(v._cache).__name__ == "FunctionCache")
    assert str(disp._cache._cache_path).startswith(numba.config.CACHE_DIR)


def test_an_inlined_module_edit_changes_the_hash(tmp_path):
    src = Path(K.__file__).parent
    dst = tmp_path / "pykv" / "kernels"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    (dst.parent / "files").mkdir()
    shutil.copy(src.parent / "files" / "formats.py", dst.parent / "files" / "formats.py")
    h0 = K.source_hash(str(dst))
    assert h0 == K.source_hash()
    tiles = dst / "tiles.py"
    tiles.write_text(tiles.read_text() + "\n# edited\n")
    h1 = K.source_hash(str(dst))
    assert h1 != h0
    fmt = dst.parent / "files" / "formats.py"
    fmt.write_text(fmt.read_text() + "\n")
    assert K.source_hash(str(dst)) != h1          # formats.py's constants are compiled in too


# A child process that compiles one signature of a cached function of a module in `folder` (argv: folder,
# type, role).  The roles widen the race Numba leaves between reading a function's index and writing its
# data file: "first" reads the index, tells "second" (a marker file) and sleeps before writing the index;
# "second" waits for the marker, then writes its index at once but sleeps before writing its data.
# Unlocked, both read an empty index and pick data file 1; the index ends naming "first"'s signature
# and the file holds "second"'s code.
_RACER = r"""
import os, sys, time
folder, ty, role = sys.argv[1:4]
sys.path.insert(0, folder)
import pykv.kernels                       # the cache folder and its lock
from numba.core import caching
marker = os.path.join(folder, "marker")
save_index, save_data = caching.IndexDataCacheFile._save_index, caching.IndexDataCacheFile._save_data
def slow_index(self, overloads):
    if role == "first":
        open(marker, "w").close()
        time.sleep(1.5)
    return save_index(self, overloads)
def slow_data(self, name, data):
    if role == "second":
        time.sleep(2.0)
    return save_data(self, name, data)
caching.IndexDataCacheFile._save_index, caching.IndexDataCacheFile._save_data = slow_index, slow_data
if role == "second":
    while not os.path.exists(marker):
        time.sleep(0.01)
import racemod
x = 3 if ty == "int" else 3.0
print(racemod.f(x))
"""

_CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import pykv.kernels
import racemod
print(racemod.f(3), racemod.f(3.0), len(racemod.f.stats.cache_hits))
"""


def test_cache_locked_here():
    assert K.cache_locked()       # POSIX: CI's hosts are; pykv.tools.warm starts no helper otherwise


def test_two_processes_saving_one_function_keep_the_cache_consistent(tmp_path):
    """Two processes save two signatures of one cached function at once (timed so that, without
    kernels/__init__'s lock, both pick the same data file); a third process must load each signature's
    own code from the cache: f(3) == 4 and f(3.0) == 4.0, both cache hits."""
    import os
    import subprocess
    import sys
    (tmp_path / "racemod.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    first = subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path), "int", "first"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path), "float", "second"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for p, want in ((first, "4"), (second, "4.0")):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.split() == [want], (out, err[-2000:])
    r = subprocess.run([sys.executable, "-c", _CHECK, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["4", "4.0", "2"], r.stdout


# Two processes need one signature at once: "first" starts compiling it (a numba:compile listener drops
# a marker) and holds the compiled code 2 s before saving it; "second" asks for it once the marker is
# there.  Prints the signature's cache hits and misses in this process.
_CLAIMER = r"""
import os, sys, time
folder, role = sys.argv[1:3]
sys.path.insert(0, folder)
import pykv.kernels                       # the cache folder, its lock and the compile claims
from numba.core import caching, event
marker = os.path.join(folder, "marker")
if role == "first":
    class Mark(event.Listener):
        def on_start(self, e):
            open(marker, "w").close()
        def on_end(self, e):
            pass
    event.register("numba:compile", Mark())
    save = caching.Cache.save_overload
    def slow_save(self, sig, data):
        time.sleep(2.0)
        return save(self, sig, data)
    caching.Cache.save_overload = slow_save
else:
    while not os.path.exists(marker):
        time.sleep(0.01)
import io
from pykv.kernels import jitnote
note = io.StringIO()
jitnote.install(note)
import racemod
print(racemod.f(3), sum(racemod.f.stats.cache_hits.values()), sum(racemod.f.stats.cache_misses.values()),
      round(jitnote.compile_seconds(), 1), "compiling kernels" in note.getvalue())
"""


def test_a_kernel_two_processes_need_at_once_is_compiled_once(tmp_path):
    """While one process compiles a cached kernel's signature, another that needs it waits for the saved
    code and loads it (kernels/__init__'s claims): the second process has a cache hit and no miss.
    Without the claim it compiles the same signature too (a miss).  The wait counts as compile time
    (kernels.jitnote: excluded from tokens/s; its one-line note)."""
    import os
    import subprocess
    import sys
    (tmp_path / "racemod.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, str(tmp_path), role], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("first", "second")]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(out.split())
    assert outs[0][:3] == ["4", "0", "1"], outs       # first: compiled it
    assert outs[1][:3] == ["4", "1", "0"], outs       # second: waited, then loaded first's code
    # the second's wait (first holds its code 2 s before saving) is compile time, with the note on stderr
    assert float(outs[1][3]) >= 1.0 and outs[1][4] == "True", outs


def _weak_functions(obj: bytes) -> list[str]:
    """Names of the weak function symbols an ELF64 (little-endian) object file defines."""
    import struct
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for name, typ, _, _, off, size, link, _, _, entsize in secs:
        if typ != 2:                  # SHT_SYMTAB
            continue
        stroff = secs[link][4]
        for k in range(size // entsize):
            st_name, info, _, shndx, _, _ = struct.unpack_from("<IBBHQQ", obj, off + k * entsize)
            if info >> 4 == 2 and info & 0xF == 2 and shndx != 0:      # STB_WEAK, STT_FUNC, defined
                end = obj.index(b"\0", stroff + st_name)
                out.append(obj[stroff + st_name:end].decode())
    return out


def test_kernels_define_no_weak_functions(tmp_path):
    """Numba links a copy of each callee into every caller as a weak (linkonce_odr) symbol, and the JIT
    binds every caller to the first copy of a name it loaded, each copy optimized with its own caller:
    a kernel's bits then depended on what the process ran before it (tests/test_shared_process.py).
    pykv.kernels makes the copies internal; a kernel with callees (the KV row quantizer) defines none."""
    import platform
    import sys
    import numpy as np
    from pykv.kernels import kvquant
    from pykv.files.formats import KV_FORMATS
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        import pytest
        pytest.skip("ELF x86-64 object code only")
    from pykv.files.formats import row_bytes
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    dst = np.zeros((2, row_bytes("q4_0", 64)), np.uint8)
    kvquant.quantize_rows(KV_FORMATS["q4_0"].code, x, dst)
    disp = kvquant.quantize_rows
    for c in disp.overloads.values():       # compiled here: its optimized module
        assert [f.name for f in c.library._final_module.functions if not f.is_declaration
                and f.linkage.name in ("linkonce_odr", "linkonce", "weak", "weak_odr")] == []
    cf = disp._cache._cache_file            # and its machine code in the cache (saved here, or loaded)
    stem = cf._index_name[:-len(".nbi")]
    objs = [o for p in Path(cf._cache_path).glob(stem + ".*.nbc") for o in _elf_blobs(pickle.loads(p.read_bytes()))]
    assert objs
    assert [_weak_functions(o) for o in objs] == [[] for _ in objs]


def _elf_blobs(o):
    if isinstance(o, (bytes, bytearray)) and o[:4] == b"\x7fELF":
        yield bytes(o)
    elif isinstance(o, (tuple, list)):
        for x in o:
            yield from _elf_blobs(x)
    elif isinstance(o, dict):
        for x in o.values():
            yield from _elf_blobs(x)
