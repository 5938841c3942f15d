"""Writes never lose data: a writer killed with SIGKILL midway leaves nothing under the final name (an
existing file there stays as it was), nothing is replaced without --force, and an input is never its
own output (same path or same inode)."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from tests.reference import write_tiny_gguf
from tests.cli.test_cli import cli
from tests.util import assert_clean_error

HF = Path(__file__).parents[1] / "data" / "hf_fixtures" / "tf4_default_untied"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("w") / "tiny.gguf", {"default": T.F32}, dim=64, ff=128,
                           n_heads=2, n_kv=1)


def kill_midway(args, tmp_glob: Path):
    """Run `pykv ARGS` with the writer pausing midway; SIGKILL it once its temp file holds bytes."""
    env = dict(os.environ, PYKV_TEST_WRITE_PAUSE="60")
    p = subprocess.Popen([sys.executable, "-m", "pykv", *map(str, args)], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            tmps = [t for t in tmp_glob.parent.glob(tmp_glob.name) if t.stat().st_size > 0]
            if tmps:
                break
            assert p.poll() is None, p.stderr.read().decode()
            time.sleep(0.05)
        else:
            pytest.fail("the writer's temp file never appeared")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert p.returncode == -signal.SIGKILL
    return tmps


@pytest.mark.parametrize("kind", ["quantize", "convert"])
def test_sigkill_midway_leaves_final_name_untouched(kind, tiny, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    args = ["quantize", tiny, out, "q8_0"] if kind == "quantize" else ["convert", HF, out, "--outtype", "q8_0"]
    kill_midway(args, tmp_path / ".out.gguf.tmp-*")
    assert not out.exists()                               # nothing half-written under the final name
    out.write_bytes(b"keep me")
    left = kill_midway(args + ["--force"], tmp_path / ".out.gguf.tmp-*")
    assert out.read_bytes() == b"keep me"                 # --force replaces only a finished file
    r = cli(capsys, *map(str, args + ["--force"]))        # the next run finishes and sweeps the dead temps
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:4] == b"GGUF"
    assert not any(t.exists() for t in left)


def test_sigkill_during_export(tiny, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    kill_midway(["export", tiny, out, "--force"], out / ".model.safetensors.tmp-*")
    assert not (out / "model.safetensors").exists()
    assert (out / "config.json").read_text() == "{}"


def test_convert_needs_force(tmp_path, capsys):
    out = tmp_path / "c.gguf"
    out.write_bytes(b"keep me")
    assert_clean_error(cli(capsys, "convert", str(HF), str(out)), "output exists")
    assert out.read_bytes() == b"keep me"


def test_input_is_never_its_own_output(tiny, tmp_path, capsys):
    src = tmp_path / "src.gguf"
    shutil.copy(tiny, src)
    link = tmp_path / "link.gguf"
    os.link(src, link)                                    # another name, the same inode
    before = src.read_bytes()
    for out in (src, link):
        assert_clean_error(cli(capsys, "quantize", str(src), str(out), "q8_0", "--force"), "is the input")
    hf = tmp_path / "hf"
    shutil.copytree(HF, hf)
    assert_clean_error(cli(capsys, "convert", str(hf), str(hf / "model.safetensors"), "--force"), "is the input")
    shutil.copy(src, hf / "config.json")                  # a GGUF named like an output of export
    assert_clean_error(cli(capsys, "export", str(hf / "config.json"), str(hf), "--force"), "is the input")
    assert src.read_bytes() == before and (hf / "config.json").read_bytes() == before
    assert (hf / "model.safetensors").read_bytes() == (HF / "model.safetensors").read_bytes()
