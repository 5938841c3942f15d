"""pykv's own GGUF parser (gguf_io) against gguf.GGUFReader, and on truncated / corrupted headers."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter

from pykv.files.config import PykvError
from pykv.files.gguf_io import GGUFFile
from tests.reference import write_tiny_gguf


def _same_as_reader(path):
    g = GGUFFile(path)
    r = GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items()}
    assert list(meta) == list(g.metadata)
    for k, v in meta.items():
        assert g.metadata[k] == v and type(g.metadata[k]) is type(v), k
    assert [t.name for t in r.tensors] == list(g.tensors)
    for t in r.tensors:
        ti = g.tensors[t.name]
        assert (ti.ggml_type, ti.shape) == (int(t.tensor_type), tuple(int(x) for x in t.shape))
        assert ti.data.dtype == t.data.dtype and ti.data.shape == t.data.shape, t.name
        assert np.array_equal(ti.data.view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name
    return g


@pytest.mark.parametrize("default", [T.F32, T.F16, T.Q8_0, T.Q4_1])
def test_parser_matches_gguf_reader(tmp_path, default):
    _same_as_reader(write_tiny_gguf(tmp_path / "m.gguf", {"default": default}))


def test_parser_metadata_value_types(tmp_path):
    """Every metadata value type, arrays of numbers and strings, unicode, an odd alignment."""
    p = tmp_path / "kv.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2 ** 63 + 5)
    w.add_int64("t.i64", -(2 ** 62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo → 世界")
    w.add_array("t.arr_i", [1, -2, 3])
    w.add_array("t.arr_f", [0.5, 1.5])
    w.add_array("t.arr_s", ["a", "", "ü"])
    w.add_custom_alignment(64)
    w.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = _same_as_reader(p)
    assert g.metadata["t.str"] == "héllo → 世界" and g.metadata["t.u64"] == 2 ** 63 + 5
    assert g.tensors["x"].data.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()


def test_every_truncation_is_a_clean_error(tmp_path):
    """Cut the file at every byte of its header (and into the data): always PykvError, never another
    exception (the parser bounds-checks every read before numpy touches the bytes)."""
    full = write_tiny_gguf(tmp_path / "full.gguf", {"default": T.Q8_0}, n_layers=1)
    data = full.read_bytes()
    header_end = GGUFReader(str(full)).data_offset
    cuts = list(range(0, header_end + 1, 7)) + [header_end + 1, len(data) - 1]
    p = tmp_path / "cut.gguf"
    for cut in cuts:
        p.write_bytes(data[:cut])
        with pytest.raises(PykvError, match="GGUF|truncated|corrupt"):
            GGUFFile(p)


def test_corrupted_header_bytes_never_crash(tmp_path):
    """Random byte flips in the header: the file either still parses or gives PykvError."""
    full = write_tiny_gguf(tmp_path / "full.gguf", {"default": T.Q4_1}, n_layers=1)
    data = full.read_bytes()
    header_end = GGUFReader(str(full)).data_offset
    rng = np.random.default_rng(3)
    p = tmp_path / "bad.gguf"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(300):
        raw = bytearray(data)
        for i in rng.integers(4, header_end, size=rng.integers(1, 4)):
            raw[i] = rng.integers(0, 256)
        p.write_bytes(bytes(raw))
        try:
            GGUFFile(p)
            outcomes["ok"] += 1
        except PykvError:
            outcomes["error"] += 1
    assert outcomes["error"] > 0


def test_big_endian_and_version_rejected(tmp_path):
    full = write_tiny_gguf(tmp_path / "full.gguf", {"default": T.F32}, n_layers=1)
    raw = bytearray(full.read_bytes())
    raw[4:8] = (3).to_bytes(4, "big")
    (tmp_path / "be.gguf").write_bytes(bytes(raw))
    with pytest.raises(PykvError, match="big-endian"):
        GGUFFile(tmp_path / "be.gguf")
    raw[4:8] = (1).to_bytes(4, "little")
    (tmp_path / "v1.gguf").write_bytes(bytes(raw))
    with pytest.raises(PykvError, match="version 1"):
        GGUFFile(tmp_path / "v1.gguf")
