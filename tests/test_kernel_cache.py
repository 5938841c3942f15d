"""Numba's on-disk cache is keyed by every kernel source (pykv/kernels/__init__.py): an edit to a
module that other kernels inline (tiles.py) must move the cache, or stale machine code loads."""
import shutil
from pathlib import Path

import numba

import pykv.kernels as K
from pykv.kernels import matmul


def test_cache_dir_is_the_source_hash():
    assert Path(numba.config.CACHE_DIR).name == K.source_hash()
    # a cached kernel of matmul.py is looked up under that folder, not in __pycache__
    disp = next(v for v in vars(matmul).values() if getattr(v, "_cache", None) is not None
                and type(v._cache).__name__ == "FunctionCache")
    assert str(disp._cache._cache_path).startswith(numba.config.CACHE_DIR)


def test_an_inlined_module_edit_changes_the_hash(tmp_path):
    src = Path(K.__file__).parent
    dst = tmp_path / "pykv" / "kernels"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(src.parent / "formats.py", dst.parent / "formats.py")
    h0 = K.source_hash(str(dst))
    assert h0 == K.source_hash()
    tiles = dst / "tiles.py"
    tiles.write_text(tiles.read_text() + "\n# edited\n")
    h1 = K.source_hash(str(dst))
    assert h1 != h0
    (dst.parent / "formats.py").write_text((dst.parent / "formats.py").read_text() + "\n")
    assert K.source_hash(str(dst)) != h1          # formats.py's constants are compiled in too
