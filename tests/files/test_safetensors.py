"""pykv's safetensors reader against the safetensors library on files transformers wrote, and files
pykv writes (through the library) read back by the library: the same names, shapes and values."""
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from pykv.files import hf

FIX = Path(__file__).resolve().parents[1] / "data" / "hf_fixtures"
FILES = sorted(FIX.glob("*/model.safetensors"))


@pytest.mark.parametrize("path", FILES, ids=[p.parent.name for p in FILES])
def test_reader_equals_the_library(path):
    ours = hf.SafetensorsFile(path)
    with safe_open(str(path), framework="np") as lib:
        assert sorted(ours.keys()) == sorted(lib.keys())
        assert ours.metadata == (lib.metadata() or {})
        for k in lib.keys():
            sl = lib.get_slice(k)
            assert ours.shape(k) == tuple(sl.get_shape()) and ours.dtype(k) == sl.get_dtype()
            if ours.dtype(k) == "BF16":      # numpy has no bfloat16: the library's numpy API refuses it
                with pytest.raises(TypeError):
                    lib.get_tensor(k)
                bits = ours.get(k, decode_bf16=False)
                assert bits.dtype == np.uint16
                assert np.array_equal(ours.get(k), (bits.astype(np.uint32) << 16).view(np.float32))
            else:
                assert np.array_equal(ours.get(k), lib.get_tensor(k))


def test_writer_output_reads_back_in_the_library(tmp_path):
    rng = np.random.default_rng(0)
    t = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16),
         "c": np.arange(6, dtype=np.int64).reshape(2, 3), "bf": np.array([0x3F80, 0xC000, 0x0000], np.uint16)}
    p = tmp_path / "x.safetensors"
    hf.write_safetensors(p, t, {"format": "pt"}, {"bf": "BF16"})
    with safe_open(str(p), framework="np") as lib:
        assert lib.metadata() == {"format": "pt"} and lib.get_slice("bf").get_dtype() == "BF16"
        for k in ("a", "b", "c"):
            assert np.array_equal(lib.get_tensor(k), t[k]) and lib.get_tensor(k).dtype == t[k].dtype
    ours = hf.SafetensorsFile(p)
    assert np.array_equal(ours.get("bf"), np.array([1.0, -2.0, 0.0], np.float32))
    plain = tmp_path / "plain.safetensors"
    hf.write_safetensors(plain, {k: t[k] for k in ("a", "b", "c")})
    got = load_file(str(plain))
    assert set(got) == {"a", "b", "c"} and all(np.array_equal(got[k], t[k]) for k in got)


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(hf.SafetensorsError):
        hf.write_safetensors(tmp_path / "x.safetensors", {"z": np.zeros(2, np.complex64)})
