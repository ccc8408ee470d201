"""Token files round-trip any documents: what `TokenWriter` writes, `TokenFile` and a plain pyarrow reader (fms-fsdp's
way) read back exactly, with the record's hashes those of the bytes on disk; compressed files read back exactly too."""
import hashlib, os
from pathlib import Path

import numpy as np
import pyarrow as pa
from hypothesis import given, settings, strategies as st

from nanochat_dl.arrow import TAIL_BYTES, TokenFile, TokenWriter, file_record, tail_sha256

LONG = st.builds(lambda n, k: ((np.arange(n, dtype=np.uint64) * k) % 2**32).tolist(), st.integers(1000, 30_000), st.integers(1, 2**32 - 1))
DOCS = st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=40) | LONG, max_size=30)   # long ones push files past TAIL_BYTES


@settings(max_examples=40, deadline=None)
@given(docs=DOCS)
def test_round_trip(tmp_path_factory, docs):
    path = tmp_path_factory.mktemp('rt') / 'a.arrow'
    with TokenWriter(path) as w:
        for d in docs: w.write(d)
    data = path.read_bytes()
    assert w.record == file_record(path)
    assert (w.record.bytes, w.record.sha256, w.record.documents, w.record.tokens) == (len(data), hashlib.sha256(data).hexdigest(), len(docs), sum(map(len, docs)))
    assert w.record.tail_sha256 == tail_sha256(path) == hashlib.sha256(f"{len(data)}\n".encode() + data[-TAIL_BYTES:]).hexdigest()
    with TokenFile(path) as tf:
        assert tf.mapped and [tf.doc(i).tolist() for i in range(len(tf))] == docs
    r = pa.ipc.open_file(pa.memory_map(str(path)))
    assert [r.get_batch(i)['tokens'].to_pylist() for i in range(r.num_record_batches)] == docs
    assert os.listdir(path.parent) == ['a.arrow']


@settings(max_examples=20, deadline=None)
@given(docs=DOCS, codec=st.sampled_from(['zstd', 'lz4']))
def test_compressed_files_read_by_copy(tmp_path_factory, docs, codec):
    path = tmp_path_factory.mktemp('z') / 'z.arrow'
    schema = pa.schema([('tokens', pa.uint32())])
    with pa.OSFile(str(path), 'wb') as f, pa.ipc.new_file(f, schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as w:
        for d in docs: w.write_batch(pa.record_batch([pa.array(d, pa.uint32())], schema=schema))
    with TokenFile(path) as tf:
        assert [tf.doc(i).tolist() for i in range(len(tf))] == docs and tf.lens.tolist() == list(map(len, docs))
