"""Property tests for nanochat_dl.text.shards: nanochat's order, exact cover per epoch, exact resume, shuffle, errors."""
import itertools, json, re, tempfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from nanochat_dl.text.reader import DocBatch, RowGroupReader, nanochat_state, resume_loss
from nanochat_dl.text.shards import read_documents, row_group_plan, shard_layout, split_files
from nanochat_dl.testing import toy_text, write_toy_shards
from toytext import raw_text_shard

LAYOUT = [[3, 4, 3, 5, 4], [6, 2, 5], [4, 3, 3, 4, 5, 3, 6]]   # 5, 3, 7 row groups of 2..6 documents
MODES = [dict(), dict(shuffle=True, seed=4), dict(balanced=True), dict(shuffle=True, seed=9, balanced=True)]


def take(it, n): return list(itertools.islice(it, n))


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    return write_toy_shards(tmp_path_factory.mktemp('shards'), LAYOUT)


def nanochat_order(files, rank, world_size, batch_size):
    """Direct transcription of the order of nanochat's `_document_batches` (no resume): every file in turn, row groups
    rank, rank+W, ..., each cut at multiples of batch_size; epochs counted from 1."""
    epoch = 1
    while True:
        for pq_idx, path in enumerate(files):
            pf = pq.ParquetFile(path)
            rg_idx = rank
            while rg_idx < pf.num_row_groups:
                batch = pf.read_row_group(rg_idx).column('text').to_pylist()
                for i in range(0, len(batch), batch_size):
                    yield batch[i:i + batch_size], (pq_idx, rg_idx, epoch)
                rg_idx += world_size
        epoch += 1


def docs_by_epoch(reader, epochs):
    out = {e: [] for e in range(1, epochs + 1)}
    for b in reader:
        if b.epoch > epochs: return out
        out[b.epoch] += b.addrs


layouts = st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=6), min_size=1, max_size=4)


def _has_docs(layout, rank, W, balanced=False):
    return any(layout[f][g] for f, g in row_group_plan(layout, rank, W, balanced=balanced))


# -- nanochat's order -------------------------------------------------------------------------------------------

@pytest.mark.parametrize('W', [1, 2, 3, 4, 5])
@pytest.mark.parametrize('bs', [1, 2, 3, 128])
def test_same_order_as_nanochat(files, W, bs):
    for rank in range(W):
        ref = take(nanochat_order(files, rank, W, bs), 60)
        got = take(RowGroupReader(files, rank, W, bs), 60)
        assert [b.texts for b in got] == [t for t, _ in ref]
        assert [(b.addrs[0][0], b.addrs[0][1], b.epoch) for b in got] == [a for _, a in ref]
        assert all(t == toy_text(*a) for b in got for t, a in zip(b.texts, b.addrs))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts, W=st.integers(1, 5), bs=st.integers(1, 4), data=st.data())
def test_same_order_as_nanochat_any_layout(layout, W, bs, data):
    rank = data.draw(st.integers(0, W - 1))
    if not _has_docs(layout, rank, W): return
    with tempfile.TemporaryDirectory() as d:
        fs = write_toy_shards(d, layout)
        n = 3 * sum(-(-layout[f][g] // bs) for f, g in row_group_plan(layout, rank, W))
        ref = take(nanochat_order(fs, rank, W, bs), n)
        got = take(RowGroupReader(fs, rank, W, bs), n)
        assert [(b.texts, (b.addrs[0][0], b.addrs[0][1], b.epoch)) for b in got] == ref


# -- exact cover per epoch ----------------------------------------------------------------------------------------

@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('W', [1, 2, 3, 4, 5])
def test_ranks_cover_split_exactly_once_per_epoch(files, W, mode):
    every = Counter((f, g, r) for f, rows in enumerate(LAYOUT) for g, n in enumerate(rows) for r in range(n))
    per_rank = [docs_by_epoch(RowGroupReader(files, r, W, 2, **mode), 3) for r in range(W)]
    for e in (1, 2, 3):
        assert Counter(a for d in per_rank for a in d[e]) == every
    for r1, r2 in itertools.combinations(range(W), 2):   # disjoint (balanced+shuffle: disjoint within each epoch)
        for e in (1, 2, 3): assert not set(per_rank[r1][e]) & set(per_rank[r2][e])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts, W=st.integers(1, 5), mode=st.sampled_from(MODES))
def test_cover_any_layout(layout, W, mode):
    if not all(_has_docs(layout, r, W, mode.get('balanced', False)) for r in range(W)): return
    every = Counter((f, g, r) for f, rows in enumerate(layout) for g, n in enumerate(rows) for r in range(n))
    with tempfile.TemporaryDirectory() as d:
        fs = write_toy_shards(d, layout)
        per_rank = [docs_by_epoch(RowGroupReader(fs, r, W, 3, **mode), 2) for r in range(W)]
    for e in (1, 2): assert Counter(a for p in per_rank for a in p[e]) == every


# -- exact resume -------------------------------------------------------------------------------------------------

def _stream(files, rank, W, bs, mode, epochs):
    rd = RowGroupReader(files, rank, W, bs, **mode)
    states, batches = [], []
    while True:
        states.append(json.loads(json.dumps(rd.state_dict())))
        b = next(rd)
        if b.epoch > epochs: return states, batches
        batches.append(b)


@pytest.mark.parametrize('mode', MODES)
@pytest.mark.parametrize('W,bs', [(1, 2), (1, 5), (2, 3), (3, 2), (4, 1)])
def test_resume_from_every_position(files, W, bs, mode):
    for rank in range(W):
        states, batches = _stream(files, rank, W, bs, mode, epochs=3)
        n2 = sum(b.epoch <= 2 for b in batches)
        for k in range(n2):   # every state in the first two epochs; compare through the end of epoch 3
            resumed = RowGroupReader(files, rank, W, bs, **mode).load_state_dict(states[k])
            assert take(resumed, len(batches) - k) == batches[k:]


@pytest.mark.parametrize('mode', MODES)
def test_resume_twice_and_with_other_batch_size(files, mode):
    ref = take(RowGroupReader(files, 1, 2, 3, **mode), 50)
    a = RowGroupReader(files, 1, 2, 3, **mode); take(a, 9)
    b = RowGroupReader(files, 1, 2, 3, **mode).load_state_dict(a.state_dict()); take(b, 11)
    c = RowGroupReader(files, 1, 2, 3, **mode).load_state_dict(b.state_dict())
    assert take(c, 30) == ref[20:]
    flat = [(x.epoch, ad) for x in ref for ad in x.addrs]
    head = [(x.epoch, ad) for x in ref[:9] for ad in x.addrs]
    for bs2 in (1, 2, 4, 100):
        r2 = RowGroupReader(files, 1, 2, bs2, **mode).load_state_dict(a.state_dict())
        got = [(x.epoch, ad) for x in take(r2, 60) for ad in x.addrs]
        assert (head + got)[:len(flat)] == flat[:len(head) + len(got)]


@pytest.mark.parametrize('mode', MODES)
def test_mid_row_group_resume_every_row(files, mode):
    """A cursor at any row of any row group (off the slice grid too): the first slice ends at the next multiple of
    batch_size, later slices are the uninterrupted ones, and the documents are the uninterrupted continuation."""
    bs = 2
    states, batches = _stream(files, 0, 2, bs, mode, epochs=2)
    flat = [(b.epoch, a) for b in batches for a in b.addrs]
    base = RowGroupReader(files, 0, 2, bs, **mode).state_dict()
    for i, (e, (f, g, r)) in enumerate(flat):
        if e != 1: break
        rd = RowGroupReader(files, 0, 2, bs, **mode).load_state_dict(dict(base, epoch=e, file=f, rg=g, row=r))
        first = next(rd)
        assert first.addrs[0] == (f, g, r) and first.addrs[-1][2] == min((r // bs + 1) * bs, LAYOUT[f][g]) - 1
        rest = take(rd, 10)
        got = [(x.epoch, a) for x in [first] + rest for a in x.addrs]
        assert got == flat[i:i + len(got)]
        assert all(x.addrs[0][2] % bs == 0 for x in rest)   # back on the grid


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts, W=st.integers(1, 4), bs=st.integers(1, 4), mode=st.sampled_from(MODES), data=st.data())
def test_resume_any_layout(layout, W, bs, mode, data):
    rank = data.draw(st.integers(0, W - 1))
    if not _has_docs(layout, rank, W, mode.get('balanced', False)): return
    with tempfile.TemporaryDirectory() as d:
        fs = write_toy_shards(d, layout)
        states, batches = _stream(fs, rank, W, bs, mode, epochs=2)
        k = data.draw(st.integers(0, len(batches) - 1))
        resumed = RowGroupReader(fs, rank, W, bs, **mode).load_state_dict(states[k])
        assert take(resumed, len(batches) - k) == batches[k:]


def test_state_is_plain_and_validated(files):
    rd = RowGroupReader(files, 1, 2, 4)
    sd = rd.state_dict()
    assert sd == dict(epoch=1, file=0, rg=1, row=0, rank=1, world_size=2, n_files=3, shuffle=False, seed=0,
                      balanced=False, batch_size=4)
    assert json.loads(json.dumps(sd)) == sd
    for other, msg in [(RowGroupReader(files, 1, 3, 4), 'saved with world_size=2 but this reader has world_size=3'),
                       (RowGroupReader(files, 0, 2, 4), 'saved with rank=1 but this reader has rank=0'),
                       (RowGroupReader(files[:2], 1, 2, 4), 'saved with n_files=3 but this reader has n_files=2'),
                       (RowGroupReader(files, 1, 2, 4, shuffle=True), 'saved with shuffle=False'),
                       (RowGroupReader(files, 1, 2, 4, balanced=True), 'saved with balanced=False')]:
        with pytest.raises(ValueError, match=msg): other.load_state_dict(sd)
    with pytest.raises(ValueError, match='rg=0, which is not a row group of rank 1'): rd.load_state_dict(dict(sd, rg=0))
    with pytest.raises(ValueError, match='file=3'): rd.load_state_dict(dict(sd, file=3))
    with pytest.raises(ValueError, match='epoch=0'): rd.load_state_dict(dict(sd, epoch=0))
    with pytest.raises(ValueError, match='missing'): rd.load_state_dict({'epoch': 1, 'file': 0})


# -- shuffle ------------------------------------------------------------------------------------------------------

def _rg_order(reader, epoch, n=200):
    return list(dict.fromkeys(b.addrs[0][:2] for b in take(reader, n) if b.epoch == epoch))


@pytest.mark.parametrize('balanced', [False, True])
def test_shuffle_deterministic_per_seed_and_epoch(files, balanced):
    mk = lambda seed, rank=0, W=1: RowGroupReader(files, rank, W, 2, shuffle=True, seed=seed, balanced=balanced)
    assert take(mk(5), 100) == take(mk(5), 100)
    o1, o2, o3 = _rg_order(mk(5), 1), _rg_order(mk(5), 2), _rg_order(mk(5), 3)
    assert len({tuple(o1), tuple(o2), tuple(o3)}) == 3          # 15! orders: a collision would be a bug
    assert o1 != _rg_order(mk(6), 1)
    assert sorted(o1) == sorted(o2) == row_group_plan(LAYOUT, 0, 1)
    if not balanced:   # the striding set is kept: rank r still reads row groups g with g % W == r
        for r in range(3): assert all(g % 3 == r for _, g in _rg_order(mk(5, r, 3), 2))


# -- laziness: one row group at a time, footers on demand ----------------------------------------------------------

def test_each_row_group_read_once_per_epoch(files, monkeypatch):
    reads = []
    orig = pq.ParquetFile.read_row_group
    def spy(self, i, *a, **kw):
        reads.append(i); return orig(self, i, *a, **kw)
    monkeypatch.setattr(pq.ParquetFile, 'read_row_group', spy)
    rd = RowGroupReader(files, 0, 2, 1)    # batch_size 1: many batches per row group
    docs_by_epoch(rd, 1)
    assert len(reads) == len(row_group_plan(LAYOUT, 0, 2)) + 1   # +1: the first row group of epoch 2, read to end epoch 1


def test_footers_are_read_lazily(tmp_path):
    fs = write_toy_shards(tmp_path, [[3, 3], [2], [4]])
    fs[2].write_bytes(b'broken' * 20)
    rd = RowGroupReader(fs, 0, 1, 2)
    assert [b.addrs[0] for b in take(rd, 3)] == [(0, 0, 0), (0, 0, 2), (0, 1, 0)]   # file 2 not touched yet
    take(rd, 2)
    with pytest.raises(ValueError, match=f'{fs[2]}: not a readable parquet shard'): next(rd)


# -- errors -------------------------------------------------------------------------------------------------------

def test_no_work_for_rank_raises(files):
    with pytest.raises(ValueError, match='rank 7 of world_size 8 has no documents'): next(RowGroupReader(files, 7, 8))
    with pytest.raises(ValueError, match='rank 7 of world_size 8 has no documents'):
        RowGroupReader(files, 7, 8, shuffle=True).state_dict()
    with pytest.raises(ValueError, match='the split has 15 non-empty row groups'): next(RowGroupReader(files, 15, 16, balanced=True))
    assert next(RowGroupReader(files, 14, 15, balanced=True)).addrs[0] == (2, 6, 0)


def test_corrupt_shards_name_the_file(tmp_path):
    garbage = tmp_path/'garbage.parquet'; garbage.write_bytes(b'\x00\x01not parquet' * 50)
    with pytest.raises(ValueError, match=f'{garbage}: not a readable parquet shard') as e: next(RowGroupReader([garbage]))
    assert "expected a parquet file with a string column 'text'" in str(e.value)
    other = tmp_path/'other.parquet'; pq.write_table(pa.table({'body': ['x']}), other)
    with pytest.raises(ValueError, match=f"{other}: has no column 'text'"): next(RowGroupReader([other]))
    with pytest.raises(ValueError, match=f"{other}: has no column 'text'"): read_documents([other], [(0, 0, 0)])
    nums = tmp_path/'nums.parquet'; pq.write_table(pa.table({'text': [1.5]}), nums)
    with pytest.raises(ValueError, match=f"{nums}: column 'text' has type double"): shard_layout([nums])
    with pytest.raises(FileNotFoundError, match='does not exist'): next(RowGroupReader([tmp_path/'missing.parquet']))


def test_split_errors_name_the_directory(tmp_path):
    with pytest.raises(ValueError, match="got 'dev'"): split_files('dev', tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path/'nope')): split_files('train', tmp_path/'nope')
    with pytest.raises(FileNotFoundError, match=f'no .parquet shards in {tmp_path}'): split_files('val', tmp_path)
    write_toy_shards(tmp_path, [[1]])
    with pytest.raises(ValueError, match=f'{tmp_path} holds a single shard'): split_files('train', tmp_path)
    write_toy_shards(tmp_path, [[1], [2], [3]])
    assert [p.name for p in split_files('train', tmp_path)] == ['shard_00000.parquet', 'shard_00001.parquet']
    assert [p.name for p in split_files('val', tmp_path)] == ['shard_00002.parquet']
    rd = RowGroupReader.for_split('val', tmp_path, rank=0, world_size=1)
    assert next(rd).texts == ['f2-g0-r0', 'f2-g0-r1', 'f2-g0-r2']


# -- addresses and nanochat's approximate resume ------------------------------------------------------------------

def test_read_documents_roundtrip(files):
    batches = take(RowGroupReader(files, 1, 2, 3, shuffle=True), 20)
    addrs = [a for b in batches for a in b.addrs][::-1]
    texts = [t for b in batches for t in b.texts][::-1]
    assert read_documents(files, addrs) == texts
    assert read_documents(files, json.loads(json.dumps(addrs))) == texts


def test_nanochat_resume_skips_rest_of_row_group(files):
    rd = RowGroupReader(files, 0, 1, 2)
    b = next(rd)   # f0-g0 rows 0,1 of 3
    assert nanochat_state(b) == {'pq_idx': 0, 'rg_idx': 0, 'epoch': 1}
    assert next(RowGroupReader.from_nanochat_state(files, nanochat_state(b), 0, 1, 2)).addrs[0] == (0, 1, 0)
    loss = resume_loss(files, 0, 1, 2)
    # after each slice, nanochat loses the rest of that row group
    want = [n - min(i + 2, n) for rows in LAYOUT for n in rows for i in range(0, n, 2)]
    assert loss == want


@pytest.mark.parametrize('mode', MODES)
def test_empty_row_groups_never_stall(tmp_path, mode):
    fs = write_toy_shards(tmp_path, [[4, 0, 0, 2], [0, 3], [0]])
    for rank in range(2):
        per_epoch = docs_by_epoch(RowGroupReader(fs, rank, 2, 2, **mode), 6)
        assert all(per_epoch[e] for e in per_epoch)      # balanced + shuffle: never an epoch of only empty groups
    both = [docs_by_epoch(RowGroupReader(fs, r, 2, 2, **mode), 3) for r in range(2)]
    for e in (1, 2, 3): assert sorted(both[0][e] + both[1][e]) == sorted(
        (f, g, r) for f, rows in enumerate([[4, 0, 0, 2], [0, 3], [0]]) for g, n in enumerate(rows) for r in range(n))


# -- invalid UTF-8 in a shard: named down to the row, or replaced on request -----------------------------------------



def test_invalid_utf8_is_named_or_replaced(tmp_path):
    p = raw_text_shard(tmp_path / 'shard_00000.parquet', [[b'one', b'two'], [b'ok', b'bad \xff\xfe byte', b'fine']])
    want = re.escape(f"{p}: row group 1, row 1: 'text' is not valid UTF-8 (invalid start byte at byte 4: b'bad \\xff\\xfe byte'); "
                     "pass utf8_errors='replace'")
    rd = RowGroupReader([p], batch_size=2)
    assert next(rd).texts == ['one', 'two']
    with pytest.raises(ValueError, match=want): next(rd)
    with pytest.raises(ValueError, match=want): read_documents([p], [(0, 1, 2)])
    got = [t for b in take(RowGroupReader([p], batch_size=2, utf8_errors='replace'), 3) for t in b.texts]
    assert got == ['one', 'two', 'ok', 'bad \ufffd\ufffd byte', 'fine']
    assert read_documents([p], [(0, 1, 1), (0, 0, 0)], utf8_errors='replace') == ['bad \ufffd\ufffd byte', 'one']
    with pytest.raises(ValueError, match=r"utf8_errors='ignore' is invalid: expected 'strict' .* or 'replace'"):
        RowGroupReader([p], utf8_errors='ignore')
