"""io: zero-copy vector reads, atomic writes, clear errors on corrupted files."""

from __future__ import annotations

import gc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nla.datagen.io import DatagenError, read_parquet, read_vectors, vectors_to_arrow, write_parquet_atomic


def test_roundtrip_and_zero_copy(tmp_path):
    v = np.arange(12, dtype=np.float32).reshape(4, 3)
    table = pa.table({"activation_vector": vectors_to_arrow(v), "doc_id": pa.array([0, 0, 1, 1])})
    write_parquet_atomic(table, tmp_path / "a.parquet")
    arr = read_vectors(tmp_path / "a.parquet")
    assert isinstance(arr, np.ndarray) and arr.dtype == np.float32 and arr.shape == (4, 3)
    np.testing.assert_array_equal(arr, v)
    # zero-copy: the array is a view of the arrow buffer, not a copy owning its data
    arr2 = read_vectors(table)
    assert not arr2.flags.owndata
    assert arr2.base is not None
    # sliced tables (non-zero offset) still give the right rows
    np.testing.assert_array_equal(read_vectors(table.slice(1, 2)), v[1:3])


def test_no_python_float_objects_created():
    v = np.random.default_rng(0).standard_normal((2000, 16)).astype(np.float32)
    table = pa.table({"activation_vector": vectors_to_arrow(v)})
    gc.collect()
    before = sum(type(o) is float for o in gc.get_objects())
    arr = read_vectors(table)
    after = sum(type(o) is float for o in gc.get_objects())
    assert after - before < 100  # 32k values read; a list-based reader would create ~32k floats
    np.testing.assert_array_equal(arr, v)


def test_float64_column_is_cast():
    table = pa.table({"activation_vector": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float64()))})
    arr = read_vectors(table)
    assert arr.dtype == np.float32 and arr.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_ragged_and_null_rows_named():
    ragged = pa.table(
        {"activation_vector": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0]], pa.list_(pa.float32()))}
    )
    with pytest.raises(DatagenError, match=r"row 2 has 1 values, expected 2 like row 0"):
        read_vectors(ragged)
    nulls = pa.table({"activation_vector": pa.array([[1.0], None], pa.list_(pa.float32()))})
    with pytest.raises(DatagenError, match=r"row 1 is null"):
        read_vectors(nulls)
    with pytest.raises(DatagenError, match=r"column 'vec' missing; found columns \['activation_vector'\]"):
        read_vectors(nulls, column="vec")


def test_corrupted_and_truncated_parquet_named(tmp_path):
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"x": list(range(100))}), good)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(good.read_bytes()[:50])
    with pytest.raises(
        DatagenError, match=r"bad.parquet: not a readable parquet file.*corrupted or truncated"
    ):
        read_parquet(bad)
    with pytest.raises(FileNotFoundError, match=r"nope.parquet: parquet file not found"):
        read_parquet(tmp_path / "nope.parquet")


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "sub" / "t.parquet"
    # an empty struct column cannot be written as parquet: write_table fails after the temp file exists
    bad = pa.table({"s": pa.array([{}], pa.struct([]))})
    with pytest.raises(pa.ArrowException):
        write_parquet_atomic(bad, target)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # the temp file is cleaned up


def _flip_inside_vector_page(path, vectors):
    """Flip one byte inside the (uncompressed) vector column's data: the bytes of row 3's values."""
    data = bytearray(path.read_bytes())
    needle = vectors[3].astype(np.float32).tobytes()
    at = data.find(needle)
    assert at > 0, "the vector bytes were not found raw in the file"
    data[at + 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_file_nla_wrote_is_refused(tmp_path):
    """Issue 21: a byte flipped inside the vectors' data page still decoded, into a vector whose
    norm jumped; nla's parquet files now carry page checksums and every read verifies them."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((8, 16)).astype(np.float32)
    table = pa.table({"activation_vector": vectors_to_arrow(vectors), "doc_id": np.arange(8)})
    ours = write_parquet_atomic(table, tmp_path / "ours.parquet")
    np.testing.assert_array_equal(read_vectors(ours), vectors)  # intact: reads as written
    _flip_inside_vector_page(ours, vectors)
    with pytest.raises(DatagenError, match=r"ours.parquet: not a readable parquet file \(a page's checksum does "
                                           r"not match its bytes\); it is corrupted"):
        read_vectors(ours)
    # The same damage in a file written without checksums decodes silently: what nla used to do.
    plain = tmp_path / "plain.parquet"
    pq.write_table(table, plain, compression="none", use_dictionary=False)
    _flip_inside_vector_page(plain, vectors)
    damaged = read_vectors(plain, check=False)
    assert not np.array_equal(damaged[3], vectors[3]) and np.array_equal(damaged[4], vectors[4])
