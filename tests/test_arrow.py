"""Token files round-trip any documents: what `TokenWriter` writes, `TokenFile` and a plain pyarrow reader (fms-fsdp's
way) read back exactly, with the record's hashes those of the bytes on disk; compressed files read back exactly too."""
import hashlib, os
from pathlib import Path

import numpy as np
import pyarrow as pa
from hypothesis import given, settings, strategies as st

from nanochat_dl.tokens import TAIL_BYTES, TokenFile, TokenWriter, file_record, tail_sha256, write_token_file

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


# ---------------------------------------------------------------- token ids out of range

import pytest
from nanochat_dl.tokens import TokenRoot


def _typed_file(path, docs, typ):
    "A token file whose column has type `typ` (other tools write int32, int64 or uint64 ids)."
    path.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([('tokens', typ)])
    with pa.OSFile(str(path), 'wb') as f, pa.ipc.new_file(f, schema) as w:
        for d in docs: w.write_batch(pa.record_batch([pa.array(d, typ)], schema=schema))


@pytest.mark.parametrize('typ, bad', [(pa.int32(), -1), (pa.int64(), -7), (pa.int64(), 2**32), (pa.uint64(), 2**63), (pa.uint64(), 2**64 - 1)])
def test_ids_outside_uint32_are_refused_naming_file_and_document(tmp_path, typ, bad):
    path = tmp_path / 'web' / 'a.arrow'
    _typed_file(path, [[1, 2], [3, bad, 4], [5]], typ)
    with TokenFile(path) as tf:
        assert tf.doc(0).tolist() == [1, 2] and tf.doc(2).tolist() == [5]
        with pytest.raises(ValueError, match=rf"^{path}: document 1 holds id {bad}: expected ids in \[0, 2\*\*32\)"): tf.doc(1)
    with TokenRoot(tmp_path) as tr, pytest.raises(ValueError, match=f"document 1 holds id {bad}"): tr.doc('web', 'a.arrow', 1)


def test_ids_beyond_the_vocabulary_given_are_refused(tmp_path):
    write_token_file(tmp_path / 'web' / 'a.arrow', [[1, 2], [3, 511, 512]])
    fp = dict(vocab_size=512, bos_id=0, sha='0' * 16)
    with TokenRoot(tmp_path, tokenizer=fp) as tr:
        assert tr.doc('web', 'a.arrow', 0).tolist() == [1, 2]
        with pytest.raises(ValueError, match=rf"a.arrow: document 1 holds id 512: expected ids below the tokenizer's vocabulary size 512"):
            tr.doc('web', 'a.arrow', 1)
        assert tr.open_args()['tokenizer'] == fp   # a loader's worker processes open the root with the same bound
    with TokenRoot(tmp_path) as tr: assert tr.doc('web', 'a.arrow', 1).tolist() == [3, 511, 512]   # no tokenizer given: uint32 ids are in range
