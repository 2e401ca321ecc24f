"""jmarl's GGUF container reader (`jmarl.models.gguf_file`) against ggml's own writer and reader
(the `gguf` package): every metadata value type, string and numeric arrays, tensor data of plain
and quantised types, custom alignment; and clear errors on files that are not GGUF or are cut
short."""

from __future__ import annotations

import numpy as np
import pytest

from jmarl.errors import JmarlError
from jmarl.models.gguf import GGUFFile
from jmarl.models.gguf_file import GGUFFormatError, read_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package (ggml's GGUF reader) is not installed")


def _write(path, alignment: int | None = None) -> dict:
    """A GGUF file with one key of each value type and three tensors; the values written."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    values = {
        "t.u8": (w.add_uint8, 200), "t.i8": (w.add_int8, -100), "t.u16": (w.add_uint16, 60000),
        "t.i16": (w.add_int16, -30000), "t.u32": (w.add_uint32, 4_000_000_000), "t.i32": (w.add_int32, -2_000_000_000),
        "t.f32": (w.add_float32, 1e-6), "t.f64": (w.add_float64, 0.1), "t.u64": (w.add_uint64, 2**63 + 5),
        "t.i64": (w.add_int64, -(2**62)), "t.bool": (w.add_bool, True), "t.str": (w.add_string, "héllo\nworld"),
        "t.strs": (w.add_array, ["a", "", "ünï", "<|end|>"] * 50), "t.ints": (w.add_array, [3, 1, 4, 1, 5]),
        "t.floats": (w.add_array, [0.5, 1e-6, -2.25]),
    }
    for key, (add, value) in values.items():
        add(key, value)
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    f16 = rng.standard_normal((2, 32)).astype(np.float16)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("a.weight", f32)
    w.add_tensor("b.weight", f16)
    w.add_tensor("c.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {key: value for key, (_, value) in values.items()}


@pytest.mark.parametrize("alignment", [None, 64])
def test_reader_equals_ggmls_reader(tmp_path, alignment):
    """Metadata values (float32 as the shortest decimal), tensor shapes, types, offsets and raw
    data equal what the gguf package's GGUFReader reads from the same file."""
    path = tmp_path / "m.gguf"
    written = _write(path, alignment)
    contents = read_gguf(str(path))
    theirs = gguf.GGUFReader(str(path), "r")
    assert contents.version == 3
    assert list(contents.metadata) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, value in written.items():
        got = contents.metadata[key]
        assert got == value and type(got) is type(value), key
    assert contents.metadata["t.f32"] == 1e-6  # not 9.99999997e-07
    f = GGUFFile(path)
    assert list(f.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        entry = f.tensors[t.name]
        assert entry.shape == tuple(int(d) for d in t.shape)
        assert entry.offset == t.data_offset and f.type_name(t.name) == t.tensor_type.name
        raw = f.raw(t.name)
        assert raw.dtype == t.data.dtype and raw.shape == t.data.shape
        np.testing.assert_array_equal(raw, t.data)
        np.testing.assert_array_equal(f.array(t.name), gguf.quants.dequantize(t.data, t.tensor_type))


def test_bad_files_are_clear_errors(tmp_path):
    """Not GGUF, a version it does not know, a header cut short, an empty file: GGUFFormatError from the
    reader, JmarlError naming the file from GGUFFile."""
    path = tmp_path / "m.gguf"
    _write(path)
    data = path.read_bytes()
    cases = [
        ("no GGUF magic", b"PK\x03\x04" + data[4:]),
        ("no GGUF magic", b"GG"),
        ("GGUF version 7", data[:4] + (7).to_bytes(4, "little") + data[8:]),
        ("truncated", data[:200]),
        ("truncated", data[:12]),
        ("the file is empty", b""),
    ]
    for message, body in cases:
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(body)
        with pytest.raises(GGUFFormatError, match=message):
            read_gguf(str(bad))
        with pytest.raises(JmarlError, match=f"{bad} is not a readable GGUF file: .*{message}"):
            GGUFFile(bad)
