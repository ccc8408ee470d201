"""The pre-tokenized loader (nbs/tokens/12i_loader.ipynb): exactly once per epoch at many world sizes, exact resume under
hypothesis, DataLoader workers, bad input. fms-fsdp's own test list, on our data: single and two epochs, chunking, two
loaders, multi-file and nested folders, reload mid-epoch and at an epoch's end, BOS/EOS placement, sampler rates, reload
stress through every stage combination, buffer formats, shuffle uniformity, checkpoint-reload match, workers."""
import contextlib, itertools, json, subprocess, sys, threading
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from nanochat_dl.tokens import TokenRoot, write_counts, write_token_file
from nanochat_dl.text.lengths import fineweb_like_lengths
from nanochat_dl.pipe.stages import ShuffleBuffer, Stage, Doc
from nanochat_dl.tokens import (PACKS, DocKey, FastTokenStream, Framing, Permutation, StreamingDataset, StreamingLoader, TokenStream,
                                   owned_shards, shard_key, stream_config)
from stateedit import DELETE, edited, paths   # a state's fields, and a copy with one edited


def toy_root(path, spec, seed=0, empty=0.05, mean=60, T=64, counts=True):
    "Datasets `{name: {file: documents}}`; token = uid << 12 | position, so each token names its document; some empty."
    rng, uid, c = np.random.default_rng(seed), 1, {}
    for ds, files in spec.items():
        for f, n in files.items():
            L = fineweb_like_lengths(n, rng, mean=mean, T=T)
            L[rng.random(n) < empty] = 0
            c[(ds, f)] = write_token_file(Path(path)/ds/f, [(np.int64(uid + i) << 12) | (np.arange(l) & 0xFFF) for i, l in enumerate(L)])
            uid += n
    if counts: write_counts(path, c)
    return Path(path)


pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")   # torchdata 0.11 on a newer torch

SPEC = {'web': {'a.arrow': 260, 'deep/er/b.arrow': 140}, 'code': {'x.arrow': 90}, 'books': {'y.arrow': 25}}


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return toy_root(tmp_path_factory.mktemp('stream')/'root', SPEC)


def runs(rle): return [v for v, c in rle for _ in range(c)]   # a trusted state's runs, expanded


from nanochat_dl.tokens import open_epochs   # per dataset, the lowest epoch that may still have tokens on a rank


def coverage(loaders, tr, epochs):
    "Run every loader until the first `epochs` of its datasets are closed; segments of those epochs, each checked against the file."
    cov = defaultdict(list)
    for ld in loaders:
        for _ in range(100_000):
            if min(open_epochs(ld.state_dict()).values()) > epochs: break
            b = next(ld)
            for r, row in enumerate(b.segments):
                for s in row:
                    k = s.key
                    assert np.array_equal(b.rows[r, s.start:s.start + s.length], tr.doc(k.dataset, k.file, k.doc)[s.offset:s.offset + s.length])
                    if k.epoch <= epochs: cov[k].append((s.offset, s.length))
        else: raise AssertionError('the epochs never closed')
        ld.close()
    return cov


def assert_tiles(cov, tr, epochs, datasets=None):
    for ds in datasets or tr.datasets:
        for fi in tr.files[ds]:
            for i, L in enumerate(tr.open(ds, fi.file).lens.tolist()):
                for e in range(1, epochs + 1):
                    pieces, at = sorted(cov.get(DocKey(ds, fi.file, i, e), [])), 0
                    for off, n in pieces:
                        assert off == at, (ds, fi.file, i, e, pieces, L)
                        at += n
                    assert at == L, (ds, fi.file, i, e, pieces, L)


# ---------------------------------------------------------------- exactly once per epoch

@pytest.mark.parametrize('pack', list(PACKS))
@pytest.mark.parametrize('W', range(1, 9))
def test_exactly_once_per_epoch(root, W, pack):
    # every stage on: delimiters, cutting, shuffle, mixing; empty documents and documents longer than a row; two epochs
    kw = dict(weights=[1, 2, 3], bos_token=1, eos_token=2, sep_token=3, n_logical_shards=24, shuffle_window=20,
              max_chunk=50, pack=pack, pack_buffer=12, prefetch=0, world_size=W)
    tr = TokenRoot(root)
    assert_tiles(coverage([StreamingLoader(root, 24, 3, rank=r, **kw) for r in range(W)], tr, 2), tr, 2)


def test_exactly_once_plain_and_more_ranks_than_shards(root):
    # no delimiters, no shuffle; 8 ranks share 5 logical shards, so three ranks own nothing of any dataset
    tr = TokenRoot(root)
    lds = []
    for r in range(8):
        try: lds.append(StreamingLoader(root, 16, 2, n_logical_shards=5, shuffle_window=0, prefetch=0, world_size=8, rank=r))
        except ValueError as e: assert 'owns no document' in str(e)
    assert len(lds) == 5
    assert_tiles(coverage(lds, tr, 1), tr, 1)


def test_an_empty_logical_shard_does_not_hold_an_epoch_open(root):
    """'books' has 25 documents in 29 logical shards, so some shards hold none: rank 0 of 18 owns only shard 0 of
    'books', which is empty. Nothing of 'books' can come from it, so epoch 1 of 'books' is over on that rank from the
    start (found by hypothesis: the epoch never closed and the chain ran forever); every other rank's epochs close too."""
    tr = TokenRoot(root)
    kw = dict(n_logical_shards=29, shuffle_window=0, prefetch=0, world_size=18, max_chunk=17, pack='pad', eos_token=2)
    with StreamingLoader(root, 24, 3, rank=0, **kw) as ld:
        assert ld.state_dict()['datasets']['books']['shards'] == [[0, 1]] and tr.files['books'][0].docs == 25
        assert open_epochs(ld.state_dict())['books'] > 1
    assert_tiles(coverage([StreamingLoader(root, 24, 3, rank=r, **kw) for r in range(18)], tr, 1), tr, 1)


def test_two_loaders_split_an_epoch(root):
    tr = TokenRoot(root)
    kw = dict(datasets='web', n_logical_shards=6, shuffle_window=0, prefetch=0, world_size=2)
    cov = [coverage([StreamingLoader(root, 16, 2, rank=r, **kw)], tr, 1) for r in range(2)]
    assert not set(cov[0]) & set(cov[1])
    assert_tiles({**cov[0], **cov[1]}, tr, 1, ['web'])


def test_single_and_two_epochs_multi_file_nested(root):
    # one loader over the nested, two-file dataset: epoch 1 and epoch 2 each deliver every document once, in other orders
    tr = TokenRoot(root)
    ld = StreamingLoader(root, 16, 2, datasets='web', shuffle_window=0, prefetch=0, n_logical_shards=7)
    order = defaultdict(list)
    for _ in range(100_000):
        if min(open_epochs(ld.state_dict()).values()) > 2: break
        for row in next(ld).segments:
            for s in row:
                if s.offset == 0: order[s.key.epoch].append((s.key.file, s.key.doc))
    assert {f for f, _ in order[1]} == {'a.arrow', 'deep/er/b.arrow'}
    nonempty = sorted((fi.file, i) for fi in tr.files['web'] for i, L in enumerate(tr.open('web', fi.file).lens) if L)
    assert sorted(order[1]) == nonempty == sorted(order[2])
    assert order[1] != order[2]


# ---------------------------------------------------------------- exact resume

def run_rows(make, n):
    ld = make()
    out = [(b.rows.copy(), json.loads(json.dumps(b.state))) for b in itertools.islice(ld, n)]
    ld.close()
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(pack=st.sampled_from(list(PACKS)), seq_len=st.integers(3, 40), window=st.sampled_from([0, 1, 7, 60]),
       max_chunk=st.sampled_from([None, 1, 5, 33]), delims=st.sampled_from([(None, None, None), (1, None, None), (1, 2, 3), (None, 2, None)]),
       shards=st.sampled_from([1, 5, 64]), prefetch=st.sampled_from([0, 2]), at=st.integers(0, 30), seed=st.integers(0, 3))
def test_exact_resume_hypothesis(root, pack, seq_len, window, max_chunk, delims, shards, prefetch, at, seed):
    bos, eos, sep = delims
    kw = dict(weights=[1, 1, 2], bos_token=bos, eos_token=eos, sep_token=sep, n_logical_shards=shards, shuffle_window=window,
              max_chunk=max_chunk, pack=pack, pack_buffer=9, prefetch=prefetch, seed=seed)
    full = run_rows(lambda: StreamingLoader(root, seq_len, 2, **kw), at + 6)
    with StreamingLoader(root, seq_len, 2, **kw).load_state_dict(full[at][1]) as ld:
        for j in range(at + 1, at + 6): assert np.array_equal(next(ld).rows, full[j][0]), (j, at)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(pack=st.sampled_from(list(PACKS)), seq_len=st.integers(1, 40), window=st.sampled_from([0, 1, 7, 60]),
       max_chunk=st.sampled_from([None, 1, 5, 33]), delims=st.sampled_from([(None, None, None), (1, None, None), (1, 2, 3), (None, 2, 3)]),
       shards=st.sampled_from([1, 5, 64]), W=st.integers(1, 3), weights=st.sampled_from([[1, 1, 2], [0, 1, 1], [5, 0, 1]]),
       block=st.sampled_from([1, 3, 256]), seed=st.integers(0, 3), data=st.data())
def test_fast_stream_equals_simple_hypothesis(root, pack, seq_len, window, max_chunk, delims, shards, W, weights, block, seed, data):
    # the loader's FastTokenStream against TokenStream, the stages one document at a time: same rows, segments, metrics and
    # states after every batch (batch sizes drawn), across epochs, and each resumes from the other's state
    bos, eos, sep = delims
    cfg = stream_config(root, seq_len, pack=pack, shuffle_window=window, max_chunk=max_chunk, bos_token=bos, eos_token=eos, sep_token=sep,
                        n_logical_shards=shards, world_size=W, rank=data.draw(st.integers(0, W - 1)), weights=weights, seed=seed, pack_buffer=9)[1]
    tr = TokenRoot(root)
    a, b = TokenStream(tr, cfg), type('Fast', (FastTokenStream,), dict(block=block))(tr, cfg)     # draws made `block` at a time
    if a.empty: return
    for k in range(data.draw(st.integers(1, 60))):
        B = data.draw(st.integers(1, 4))
        x, y = a.next_rows(B), b.next_rows(B)
        assert np.array_equal(x.rows, y.rows), k
        assert a.doc_segments(x) == b.doc_segments(y) and x.metrics == y.metrics, k
        sa, sb = a.state_of(a.snapshot()), b.state_of(b.snapshot())
        assert sa == sb, k
    ra, rb = TokenStream(tr, cfg).load_state(json.loads(json.dumps(sb))), FastTokenStream(tr, cfg).load_state(json.loads(json.dumps(sa)))
    for _ in range(3):
        want = a.next_rows(2).rows
        assert np.array_equal(ra.next_rows(2).rows, want) and np.array_equal(rb.next_rows(2).rows, want)


@pytest.mark.parametrize('pack', list(PACKS))
def test_reload_stress_many_steps_and_twice(root, pack):
    # resume from states after many steps, and resume a resumed loader again: the same rows as one run
    kw = dict(weights=[3, 5, 1], bos_token=1, eos_token=2, n_logical_shards=15, shuffle_window=30, max_chunk=17, pack=pack,
              pack_buffer=8, prefetch=2)
    full = run_rows(lambda: StreamingLoader(root, 20, 3, **kw), 400)
    for at in (0, 1, 10, 100, 250):
        with StreamingLoader(root, 20, 3, **kw).load_state_dict(full[at][1]) as ld:
            mid = [next(ld) for _ in range(40)]
            assert all(np.array_equal(b.rows, full[at + 1 + j][0]) for j, b in enumerate(mid))
            again = json.loads(json.dumps(mid[-1].state))
        with StreamingLoader(root, 20, 3, **kw).load_state_dict(again) as ld:
            for j in range(at + 41, at + 61): assert np.array_equal(next(ld).rows, full[j][0])


def epoch_end_state(make):
    "The first batch after which a dataset's source has just started a new epoch, and the states around it."
    ld = make()
    prev = json.loads(json.dumps(ld.state_dict()))
    for k in range(5000):
        b = next(ld)
        st = json.loads(json.dumps(b.state))
        if any(runs(st['datasets'][d]['epoch']) != runs(prev['datasets'][d]['epoch']) for d in st['datasets']):
            ld.close(); return k, prev, st
        prev = st
    raise AssertionError('no epoch ended')


def test_reload_at_an_epochs_end(root):
    make = lambda: StreamingLoader(root, 16, 2, datasets=['code'], shuffle_window=0, n_logical_shards=4, prefetch=0, bos_token=1)
    k, before, after = epoch_end_state(make)
    full = run_rows(make, k + 12)
    for at, st in ((k - 1, before), (k, after)):
        assert st == full[at][1] if at >= 0 else True
        with make().load_state_dict(st) as ld:
            for j in range(at + 1, k + 12): assert np.array_equal(next(ld).rows, full[j][0])


def test_state_is_the_batch_handed_out(root):
    # a prefetching loader is batches ahead; its state_dict() is still the last batch's
    with StreamingLoader(root, 16, 2, prefetch=4, n_logical_shards=8, shuffle_window=10) as ld:
        bs = [next(ld) for _ in range(5)]
        assert ld.state_dict() == bs[-1].state and ld.state_dict()['step'] == 5
        assert bs[1].state['step'] == 2


def test_state_holds_no_tokens_and_stays_small(root):
    with StreamingLoader(root, 16, 2, bos_token=1, n_logical_shards=64, shuffle_window=50, prefetch=0) as ld:
        for _ in range(30): b = next(ld)
        text = json.dumps(b.state)
    windows = sum(min(50, 500) for _ in SPEC)
    assert len(text) < 200 * windows + 8000, len(text)          # addresses and counters: tens of bytes per buffered piece
    assert '4096' not in text and str(int(b.rows[0, 1])) not in text   # no token id (all are >= 4096 here) in it


# ---------------------------------------------------------------- delimiters, chunking, formats

@pytest.mark.parametrize('bos', [None, 1])
@pytest.mark.parametrize('chunk', [99, 100, 101, 102, 103])
def test_bos_eos_chunking_around_the_document_length(tmp_path, bos, chunk):
    write_token_file(tmp_path/'d'/'a.arrow', [np.arange(5000, 5100)])
    tr, cfg, _ = stream_config(tmp_path, 200, bos_token=bos, eos_token=2, max_chunk=chunk, pack='pad', shuffle_window=0, n_logical_shards=1)
    stream = TokenStream(tr, cfg)
    unit = ([1] if bos else []) + list(range(5000, 5100)) + [2]
    rows = stream.next_rows(6).rows
    pieces = [r[r != 0].tolist() for r in rows]                  # pad mode: one piece per row, padded with 0
    sizes = [len(p) for p in pieces]
    want = [len(unit)] if chunk >= len(unit) else [chunk, len(unit) - chunk]
    assert sizes[:len(want)] == want
    assert sum(pieces[:len(want)], []) == unit


def test_buffer_formats(root):
    tr = TokenRoot(root)
    for pack in PACKS:
        with StreamingLoader(root, 30, 4, pack=pack, eos_token=2, pad_token=0, prefetch=0, n_logical_shards=8) as ld:
            for _ in range(20):
                b = next(ld)
                assert b.rows.shape == (4, 31) and b.inputs.shape == (4, 30)
                assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
                covered = np.zeros(b.rows.shape, bool)
                for r, row in enumerate(b.segments):
                    for s in row: covered[r, s.start:s.start + s.length] = True
                other = b.rows[~covered]
                assert set(np.unique(other)) <= {0, 2}
                if pack == 'concat': assert (other == 2).all()
                if pack == 'pad': assert all(len(row) <= 1 for row in b.segments)
                pos = b.position_ids()
                for r, row in enumerate(b.segments):   # a document's tokens count up from where its unit starts
                    for s in row:
                        p = pos[r, s.start:min(s.start + s.length, 30)]
                        assert torch.equal(p, torch.arange(len(p)) + int(p[0])) if len(p) else True


def test_delimiter_value_inside_documents(tmp_path):
    write_token_file(tmp_path/'d'/'a.arrow', [[2, 2, 2], [7, 2], [2]])
    with StreamingLoader(tmp_path, 11, 1, eos_token=2, shuffle_window=0, n_logical_shards=1, prefetch=0) as ld:
        b = next(ld)
    got = sorted((s.key.doc, s.offset, s.length) for s in b.segments[0] if s.key.epoch == 1)
    assert got == [(0, 0, 3), (1, 0, 2), (2, 0, 1)]                 # ends from the file, not from the value 2
    covered = np.zeros(12, bool)
    for s in b.segments[0]: covered[s.start:s.start + s.length] = True
    assert (b.rows[0][~covered] == 2).all() and (~covered).sum() >= 3   # outside them: the EOS after each


def test_shuffle_uniformity():
    class Counting(Stage):
        def __init__(self): self.i = -1
        def __next__(self): self.i += 1; return Doc((self.i,), None)
    b = ShuffleBuffer(Counting(), 200, 0, 0)
    out = [next(b).address[0] for _ in range(1000)]
    assert sum(x < 100 for x in out) > 95


@pytest.mark.parametrize('weights,period', [([1, 1], 'Lss'), ([2, 1], 'Ls'), ([2, 3], 'Lsss')])
def test_sampler_rates(tmp_path, weights, period):
    # fms-fsdp's test: documents of two sizes in two datasets; the mixer keeps an exact periodic pattern
    write_token_file(tmp_path/'long'/'a.arrow', [np.full(20, 7)] * 50)
    write_token_file(tmp_path/'short'/'a.arrow', [np.full(10, 8)] * 50)
    with StreamingLoader(tmp_path, 30, 1, weights=weights, shuffle_window=0, n_logical_shards=3, pack='pad', prefetch=0) as ld:
        seq = ''.join('L' if next(ld).segments[0][0].key.dataset == 'long' else 's' for _ in range(60))
    assert period * 5 in seq[12:], seq


def test_permutation_bijective_hypothesis():
    @given(n=st.integers(1, 5000), key=st.integers(0, 2**64 - 1))
    @settings(max_examples=60, deadline=None)
    def check(n, key): assert sorted(Permutation(n, key)) == list(range(n))
    check()
    assert list(Permutation(50, shard_key(1, 'a', 2, 3))) != list(Permutation(50, shard_key(1, 'a', 2, 4)))


# ---------------------------------------------------------------- data on disk

def test_missing_counts_csv_gives_the_same_batches(tmp_path):
    a = toy_root(tmp_path/'a', SPEC, counts=True)
    b = toy_root(tmp_path/'b', SPEC, counts=False)
    assert not (b/'meta').exists()
    kw = dict(bos_token=1, n_logical_shards=10, prefetch=0)
    with StreamingLoader(a, 16, 2, **kw) as la, StreamingLoader(b, 16, 2, **kw) as lb:
        for _ in range(20): assert np.array_equal(next(la).rows, next(lb).rows)


def test_empty_documents_and_dry_datasets(tmp_path):
    write_token_file(tmp_path/'empty'/'a.arrow', [[]] * 7)
    write_token_file(tmp_path/'full'/'a.arrow', [[5, 6, 7]] * 4)
    # an all-empty dataset with a weight drops out; the other carries the batches
    with StreamingLoader(tmp_path, 4, 2, weights=[1, 1], shuffle_window=3, n_logical_shards=2, prefetch=0) as ld:
        for _ in range(10): assert {s.key.dataset for row in next(ld).segments for s in row} == {'full'}
    # by default (weights by tokens) it is not even read
    with StreamingLoader(tmp_path, 4, 2, prefetch=0) as ld: assert ld.config['weights'] == [0, 12]
    # alone, it is an error that says so
    with StreamingLoader(tmp_path, 4, 2, datasets='empty', weights=[1], prefetch=0) as ld:
        with pytest.raises(RuntimeError, match='no document with a token'): next(ld)


def test_fingerprint_refuses_changed_files(tmp_path):
    r = toy_root(tmp_path/'r', {'web': {'a.arrow': 30}})
    with StreamingLoader(r, 8, 2, prefetch=0, n_logical_shards=4) as ld: next(ld); sd = ld.state_dict()
    toy_root(tmp_path/'r', {'web': {'a.arrow': 30}}, seed=1)          # same names and count, other lengths
    with pytest.raises(ValueError, match="dataset 'web' differs \\(tokens"):
        StreamingLoader(r, 8, 2, prefetch=0, n_logical_shards=4).load_state_dict(sd)


GARBAGE_KW = dict(bos_token=1, max_chunk=20, n_logical_shards=6, shuffle_window=5, prefetch=0, pack='bestfit', pack_buffer=6, weights=[1, 1, 1])


@contextlib.contextmanager
def address_space(extra=2 << 30):
    "Cap this process's address space at what it maps now plus `extra` bytes (Linux), so a runaway allocation is a MemoryError, not the OOM killer."
    try:
        import resource
        vm = int(Path('/proc/self/status').read_text().split('VmSize:')[1].split()[0]) * 1024
    except (ImportError, OSError, IndexError, ValueError): yield; return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + extra if hard == resource.RLIM_INFINITY else min(vm + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try: yield
    finally: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_garbage_states_are_refused_cleanly(root, data):
    # any damage to a valid state: refused with ValueError/TypeError, or loaded; never another error, never half-loaded.
    # The junk is bounded, and the load runs under an address-space cap: a state asking for too much is a MemoryError here, never an OOM kill
    with StreamingLoader(root, 12, 2, **GARBAGE_KW) as ld:
        for _ in range(7): next(ld)
        sd = json.loads(json.dumps(ld.state_dict()))
    p = data.draw(st.sampled_from(paths(sd)[1:]))
    junk = data.draw(st.sampled_from([None, -1, 0, 1, 2, 10**4, 2**64, 'x', [], {}, 1.5, [[1, 2, 3]], [[0, 10**4]], [[1, 10**4]]]))
    fresh = StreamingLoader(root, 12, 2, **GARBAGE_KW)
    bad = edited(sd, p, junk) or json.loads(json.dumps(sd))   # (the same state where the field held that value)
    with address_space():
        try: fresh.load_state_dict(bad); err = None
        except (ValueError, TypeError) as e:
            err = str(e)
            assert np.array_equal(next(fresh).rows, next(StreamingLoader(root, 12, 2, **GARBAGE_KW)).rows)
        else: next(fresh)
        if p[0] in ('datasets', 'packer', 'step'):     # past the settings' checks: the simple stream refuses it in the same words
            try: TokenStream(fresh.root, fresh.stream.cfg).load_state(bad); simple = None
            except (ValueError, TypeError) as e: simple = str(e)
            if err and "['checksum'] does not match" in err: err = None     # the stream has no checksum: the loader checks it last
            assert simple == err, (p, junk)
    fresh.close()


@pytest.mark.parametrize('shuffle', ['block', 'reservoir'])
def test_every_field_edited_is_refused_naming_it_alone_and_in_a_list(root, shuffle):
    """The sweep behind the property test above, done exhaustively for one state: every field and list item replaced by
    each of a set of values of other kinds, or deleted, and loaded alone and as a one-rank list (the path of a rescale).
    Each is refused with a ValueError or TypeError whose message speaks of the state and names a key on the way to the
    edited field (a setting's name, a dataset's, a stage's), or, passing every check of a field, by the state's checksum;
    none loads; no other exception. Both windows' states: the block window's (a cursor) and the reservoir's (its pieces)."""
    kw = dict(GARBAGE_KW, shuffle=shuffle)
    with StreamingLoader(root, 12, 2, **kw) as ld:
        for _ in range(7): next(ld)
        sd = json.loads(json.dumps(ld.state_dict()))
    wrong, by_checksum = [], 0
    for p in paths(sd)[1:]:
        for junk in (None, -1, 0, 1, 2**64, 'x', [], {}, 1.5, True, DELETE):
            if (bad := edited(sd, p, junk)) is None: continue
            for form in (bad, [bad]):
                fresh = StreamingLoader(root, 12, 2, **kw)
                try: fresh.load_state_dict(form); next(fresh); wrong.append((p, junk, type(form).__name__, 'loaded'))
                except (ValueError, TypeError) as e:
                    if "['checksum'] does not match the state's contents" in str(e): by_checksum += 1
                    elif not ('state' in str(e) and any(isinstance(k, str) and k in str(e) for k in p)): wrong.append((p, junk, type(form).__name__, str(e)[:300]))
                except Exception as e: wrong.append((p, junk, type(form).__name__, repr(e)[:200]))
                finally: fresh.close()
    assert not wrong, wrong[:5]
    assert by_checksum > 0


PLAUSIBLE = {   # single-field edits that pass every check of a state's shape and meaning, and change what comes next
    'step + 1': lambda st: st.__setitem__('step', st['step'] + 1),
    'a mix counter + 1': lambda st: st['datasets']['web'].__setitem__('tokens', st['datasets']['web']['tokens'] + 1),
    'a window draw counter + 1': lambda st: st['datasets']['web']['shuffle'].__setitem__('drawn', st['datasets']['web']['shuffle']['drawn'] + 1),
    'a block number + 1': lambda st: st['datasets']['web']['window'].__setitem__(0, st['datasets']['web']['window'][0] + 1),
    'the batch size': lambda st: st['config'].__setitem__('batch_size', st['config']['batch_size'] + 1),
}


@pytest.mark.parametrize('edit', list(PLAUSIBLE))
def test_a_plausible_edit_is_refused_by_the_checksum(root, edit):
    # issue 19: of ~2,000 single-field edits 20 loaded and changed the batches; a state now carries a checksum
    kw = dict(GARBAGE_KW, shuffle='reservoir' if 'draw counter' in edit else 'block')   # (the window that has the field)
    with StreamingLoader(root, 12, 2, **kw) as ld:
        for _ in range(7): next(ld)
        sd = json.loads(json.dumps(ld.state_dict()))
    StreamingLoader(root, 12, 2, **kw).load_state_dict(json.loads(json.dumps(sd))).close()   # as handed out: loads
    PLAUSIBLE[edit](sd)
    # (a bestfit packer's inputs by number, /5: a mix counter or block moved is caught before, its inputs pulled again)
    why = r"\['checksum'\] does not match" + (r"|inputs pulled again" if edit in ('a mix counter + 1',
                                                                                          'a block number + 1') else '')
    for form in (sd, [sd]):
        with StreamingLoader(root, 12, 2, **kw) as fresh:
            with pytest.raises(ValueError, match=why): fresh.load_state_dict(form)


def test_a_state_of_the_format_before_the_checksum_loads_unchecked(root):
    with StreamingLoader(root, 12, 2, **GARBAGE_KW) as ld:
        for _ in range(7): next(ld)
        sd = json.loads(json.dumps(ld.state_dict()))
        want = [next(ld).rows.copy() for _ in range(3)]
    old = {k: v for k, v in sd.items() if k != 'checksum'}
    old['format'] = 'nanochat_dl.streaming/2'
    from nanochat_dl.pipe.state import UNCHECKED
    UNCHECKED.discard(old['format'])
    for form in (old, [old]):
        with pytest.warns(UserWarning, match="carries no checksum: loaded unchecked") if form is old else contextlib.nullcontext():
            with StreamingLoader(root, 12, 2, **GARBAGE_KW) as fresh:
                fresh.load_state_dict(form)
                assert all(np.array_equal(next(fresh).rows, w) for w in want)


# every leaf of a valid state set to 10**9 in turn, in a process whose address space is capped: a clean refusal naming the field,
# never a MemoryError; counters that may be that large pass their own checks and are refused by the checksum
PROBE = r"""
import json, resource, sys
from nanochat_dl.tokens import StreamingLoader
root, kw, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
with StreamingLoader(root, 12, 2, **kw) as ld:
    for _ in range(steps): next(ld)
    sd = json.loads(json.dumps(ld.state_dict()))
def paths(x, p=()):
    out = [p]
    if isinstance(x, dict): out += [q for k, v in x.items() for q in paths(v, p + (k,))]
    elif isinstance(x, list): out += [q for i, v in enumerate(x) for q in paths(v, p + (i,))]
    return out
vm = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1536 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
out = []
for p in paths(sd)[1:]:
    bad = json.loads(json.dumps(sd)); x = bad
    for k in p[:-1]: x = x[k]
    x[p[-1]] = 10**9
    ld = StreamingLoader(root, 12, 2, **kw)
    try:
        ld.load_state_dict(bad); next(ld); got = ['loaded', '']
    except (ValueError, TypeError) as e: got = ['refused', str(e)]
    except BaseException as e: got = [type(e).__name__, str(e)[:200]]
    ld.close()
    out.append([list(p), *got])
print(json.dumps(out))
"""

# (a state's weights may be any: a loader with other weights, or a schedule, resumes it, its targets anchored; 12k)
LARGE_COUNTERS = {('step',), ('config', 'batch_size'), ('datasets', '*', 'tokens'), ('datasets', '*', 'shuffle', 'drawn'),
                  ('datasets', '*', 'window', 0),   # (a block number: any number is a block)
                  *(('config', 'weights', i) for i in range(3))}


@pytest.mark.skipif(not Path('/proc/self/status').exists(), reason='the address-space cap reads /proc (Linux)')
@pytest.mark.parametrize('kw,steps', [(GARBAGE_KW, 7), (dict(GARBAGE_KW, shuffle='reservoir'), 7),
                                      (dict(bos_token=1, eos_token=2, sep_token=3, n_logical_shards=5, shuffle_window=7, prefetch=0, weights=[2, 1, 1]), 9),
                                      (dict(eos_token=2, n_logical_shards=4, shuffle_window=0, prefetch=0, pack='pad'), 5)])
def test_every_leaf_at_a_billion_is_refused_without_memory(root, kw, steps):
    r = subprocess.run([sys.executable, '-c', PROBE, str(root), json.dumps(kw), str(steps)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert len(res) > 40
    crashed = [(p, what, msg) for p, what, msg in res if what not in ('loaded', 'refused')]
    assert not crashed, crashed
    generic = lambda p: tuple('*' if i == 1 and p[0] == 'datasets' else k for i, k in enumerate(p))
    loaded = sorted(tuple(p) for p, what, _ in res if what == 'loaded')
    assert not loaded, loaded
    for p, what, msg in res:     # a refusal names the field (the last key on its path); a counter that may be that large, the checksum
        if generic(tuple(p)) in LARGE_COUNTERS:     # (a block number: the block read again may also clash with the packer)
            # (/5, bestfit: a counter or weight moved is refused by the packer's inputs pulled again, naming it)
            assert "['checksum'] does not match" in msg or (p[2:] == ['window', 0] and "['window']" in msg) or (
                "pulled again" in msg and next(k for k in reversed(p) if isinstance(k, str)) in msg), (p, msg)
        elif what == 'refused': assert next(k for k in reversed(p) if isinstance(k, str)) in msg, (p, msg)


NAMED_KW = {'bestfit': dict(GARBAGE_KW, world_size=2, rank=0, shuffle='reservoir'),   # (windows named piece by piece)
            'concat': dict(bos_token=1, eos_token=2, max_chunk=30, n_logical_shards=6, shuffle_window=9, prefetch=0, pack='concat',
                           weights=[1, 1, 1], world_size=2, rank=0, shuffle='reservoir'),
            'zero': dict(eos_token=2, n_logical_shards=4, shuffle_window=0, prefetch=0, pack='pad', weights=[0, 1, 1],
                         shuffle='reservoir')}


def window(d):
    "A dataset state's shuffle window as (doc, epoch, start) triples."
    return list(zip(d['shuffle']['doc'], runs(d['shuffle']['epoch']), runs(d['shuffle']['start'])))


def set_window(d, pieces):
    from nanochat_dl.pipe.state import runs_of as _rle
    d['shuffle'].update(doc=[p[0] for p in pieces], epoch=_rle(p[1] for p in pieces), start=_rle(p[2] for p in pieces))


def geometry(root, kw):
    "The stream the state belongs to (for its sources' shards, orders and document lengths)."
    return TokenStream(TokenRoot(root), stream_config(root, 12, **{k: v for k, v in kw.items() if k != 'prefetch'})[1])


def undrawn(ts, i, d):
    "A non-empty document of dataset `i`, in the current epoch of one of its shards, not drawn yet: `(doc, epoch)`."
    src = ts.sources[i]
    for j, (e, p, n) in enumerate(zip(runs(d['epoch']), d['pos'], src.n)):
        perm = Permutation(n, shard_key(src.seed, src.dataset, src.shards[j], e)) if n else None
        for k in range(p, n):
            g = src.lo[j] + perm(k)
            if len(src.doc(g)): return g, e
    raise AssertionError('every document drawn')


def empty_doc(ts, i):
    src = ts.sources[i]
    return next(g for g in range(src.lo[0], src.lo[-1] + src.n[-1]) if not len(src.doc(g)))


def cut_behind(st):
    "Put the piece a dataset's `cut` is about to cut off into its shuffle window, as if it had been cut already."
    name, d = next((n, d) for n, d in st['datasets'].items() if d['cut'])
    set_window(d, [tuple(d['cut'])] + window(d)[1:])


def metric(**delta):
    def f(st, ts):
        m = st['packer']['metrics']
        for k, v in delta.items(): m[k] = v(m) if callable(v) else m[k] + v
        return True
    return f


CASES = {   # name: (base state, change (returns False to skip), what the refusal says)
    'entry epoch ahead of its shard': ('bestfit', lambda st, ts: st['packer']['entries'][1].__setitem__(2, 2), 'is only in epoch 1'),
    'entry of another rank': ('bestfit', lambda st, ts: st['packer']['entries'][1][1:4].__class__ and st['packer']['entries'][1].__setitem__(1, ts.sources[st['packer']['entries'][1][0]].n_docs - 1),
                              'which this unit does not walk'),
    'entry not drawn yet': ('concat', lambda st, ts: st['packer']['entries'].__setitem__(1, [2, *undrawn(ts, 2, st['datasets']['web']), 0, 0]), 'cannot have been delivered yet'),
    'entry of an empty document': ('concat', lambda st, ts: st['packer']['entries'].__setitem__(1, [2, empty_doc(ts, 2), 1, 0, 0]), 'is empty'),
    'entry start inside a piece': ('bestfit', lambda st, ts: st['packer']['entries'][1].__setitem__(3, 1), 'start 1 is not where a piece'),
    'entry offset past its piece': ('concat', lambda st, ts: st['packer']['entries'][0].__setitem__(4, 10**6), 'offset 1000000 is not possible'),
    'offset on a later entry': ('concat', lambda st, ts: st['packer']['entries'][1].__setitem__(4, 1), 'only the first entry is partly delivered'),
    'entry of a dataset with weight 0': ('zero', lambda st, ts: st['packer']['entries'][0].__setitem__(0, 0), "dataset 'books' is not read by this unit"),
    'a piece twice in a window': ('concat', lambda st, ts: set_window(st['datasets']['web'], window(st['datasets']['web'])[:1] * 2 + window(st['datasets']['web'])[2:]),
                                  'it would be delivered twice'),
    'a window piece also in the packer': ('concat', lambda st, ts: set_window(st['datasets'][st['config']['datasets'][st['packer']['entries'][1][0]]],
                                          [tuple(st['packer']['entries'][1][1:4])] + window(st['datasets'][st['config']['datasets'][st['packer']['entries'][1][0]]])[1:]),
                                          'it would be delivered twice'),
    'a buffered piece beyond the cut': ('concat', lambda st, ts: cut_behind(st), 'lies beyond'),
    'draws that disagree with the cursors': ('bestfit', lambda st, ts: st['datasets']['web'].__setitem__('draws', st['datasets']['web']['draws'] + 1), "'epoch' and 'pos' count"),
    'a shard past its last document': ('bestfit', lambda st, ts: st['datasets']['code']['pos'].__setitem__(0, 10**6), "['pos'][0]=1000000: logical shard 0 has"),
    'shards of another rank': ('bestfit', lambda st, ts: st['datasets']['code'].__setitem__('shards', [[3, 6]]), 'this unit walks logical shards 0..2'),
    'window runs that do not add up': ('bestfit', lambda st, ts: st['datasets']['web']['shuffle']['epoch'][-1].__setitem__(1, 10**12), 'its runs hold'),
    'a window holding its pieces thrice': ('bestfit', lambda st, ts: set_window(st['datasets']['web'], window(st['datasets']['web']) * 3), 'it would be delivered twice'),
    'emitted != rows * (seq_len + 1)': ('bestfit', metric(emitted=1), 'emitted='),
    'tokens_in != doc_tokens': ('bestfit', metric(tokens_in=1), 'tokens_in='),
    'tokens lost (padding miscounted)': ('bestfit', metric(padded=1), 'undelivered tokens'),
    'more segments than pieces': ('bestfit', metric(placed=lambda m: m['docs_in'] + m['rows'] + 1), 'placed='),
    'fewer pieces than entries': ('concat', metric(docs_in=lambda m: 0), 'docs_in=0'),
    'truncated > placed': ('bestfit', metric(truncated=lambda m: m['placed'] + 1), 'truncated='),
    'floor_tokens > doc_tokens': ('concat', metric(floor_tokens=lambda m: m['doc_tokens'] + 1), 'floor_tokens='),
    'a step beyond 2**63': ('bestfit', lambda st, ts: st.__setitem__('step', 2**63), "state['step']=9223372036854775808 is invalid"),
    'a batch size of 0': ('bestfit', lambda st, ts: st['config'].__setitem__('batch_size', 0), "state['config']['batch_size']=0 is invalid"),
}


@pytest.fixture(scope='module')
def named_states(root):
    out = {}
    for name, kw in NAMED_KW.items():
        with StreamingLoader(root, 12, 2, **kw) as ld:
            for _ in range(9): next(ld)
            out[name] = json.loads(json.dumps(ld.state_dict()))
        assert StreamingLoader(root, 12, 2, **kw).load_state_dict(out[name])   # the unchanged state loads
    return out


@pytest.mark.parametrize('case', list(CASES))
def test_impossible_states_are_refused_naming_the_field(root, named_states, case):
    base, change, msg = CASES[case]
    st = json.loads(json.dumps(named_states[base]))
    kw = NAMED_KW[base]
    assert change(st, geometry(root, kw)) is not False
    with StreamingLoader(root, 12, 2, **kw) as fresh, StreamingLoader(root, 12, 2, **kw) as plain:
        with pytest.raises(ValueError) as e: fresh.load_state_dict(st)
        assert msg in str(e.value), str(e.value)
        assert np.array_equal(next(fresh).rows, next(plain).rows)      # nothing of the refused state stayed


# ---------------------------------------------------------------- DataLoader workers

def test_dataloader_two_workers_split_and_resume(root):
    from torchdata.stateful_dataloader import StatefulDataLoader
    kw = dict(bos_token=1, eos_token=2, n_logical_shards=8, shuffle_window=10, weights=[1, 1, 1])
    # each worker is the TokenStream of its half of the rank's shards; the DataLoader takes them in turn
    tr = TokenRoot(root)
    cfg = stream_config(root, 16, **kw)[1]
    streams = [TokenStream(tr, cfg, w, 2) for w in range(2)]
    want = [streams[i % 2].next_rows(1).rows[0] for i in range(12)]
    dl = StatefulDataLoader(StreamingDataset(root, 16, **kw), batch_size=1, num_workers=2)
    it = iter(dl)
    got = [torch.cat([x[0], y[0, -1:]]).numpy() for x, y in itertools.islice(it, 12)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert set(owned_shards(8, 0, 1, 0, 2)) | set(owned_shards(8, 0, 1, 1, 2)) == set(range(8))
    # checkpoint-reload match: a fresh DataLoader from the state continues the stream exactly
    sd = dl.state_dict()
    rest = [x.clone() for x, _ in itertools.islice(it, 10)]
    dl2 = StatefulDataLoader(StreamingDataset(root, 16, **kw), batch_size=1, num_workers=2)
    dl2.load_state_dict(sd)
    again = [x for x, _ in itertools.islice(iter(dl2), 10)]
    assert all(torch.equal(a, b) for a, b in zip(rest, again))


def test_dataset_refuses_loader_arguments(root):
    with pytest.raises(TypeError, match="takes no \\['batch_size'\\]"): StreamingDataset(root, 8, batch_size=2)
    with pytest.raises(TypeError, match="takes no \\['views'\\]"): StreamingDataset(root, 8, views=True)   # its rows are its own


# ---------------------------------------------------------------- bad input, threads

@pytest.mark.parametrize('kw,msg', [
    (dict(seq_len=0), 'seq_len=0 is invalid'), (dict(seq_len='8'), "seq_len='8' is invalid"),
    (dict(batch_size=0), 'batch_size=0 is invalid'), (dict(datasets=['nope']), "unknown dataset(s) ['nope']"),
    (dict(weights=[1, 2]), 'weights has 2 values for 3 datasets'), (dict(weights=[1, float('nan'), 1]), "weight nan of dataset 'code'"),
    (dict(weights='abc'), "weights='abc' is invalid"), (dict(n_logical_shards=0), 'n_logical_shards=0 is invalid'),
    (dict(shuffle_window=-1), 'shuffle_window=-1 is invalid'), (dict(max_chunk=0), 'max_chunk=0 is invalid'),
    (dict(eos_token=2**32), 'eos_token=4294967296 is invalid'), (dict(tokenizer=3), 'tokenizer=3 is invalid'),
    (dict(device='tpu'), "device='tpu' is not a device"), (dict(prefetch=-1), 'prefetch=-1 is invalid'),
    (dict(max_open=0), 'max_open=0 is invalid')])
def test_bad_settings_are_named(root, kw, msg):
    args = dict(dict(seq_len=8, batch_size=2), **kw)
    with pytest.raises((ValueError, RuntimeError)) as e: StreamingLoader(root, args.pop('seq_len'), args.pop('batch_size'), **args)
    assert msg in str(e.value)


@pytest.mark.parametrize('weights, msg', [
    ([1, '1', 1], "weight '1' of dataset 'code' is invalid: expected a number (int or float) >= 0, not str"),
    ([True, 1, 1], "weight True of dataset 'books' is invalid: expected a number (int or float) >= 0, not bool"),
    ({'web': [True]}, "weight [True] of dataset 'web' is invalid: expected a number (int or float) >= 0, not list"),
    ([1e308, 1e308, 1], "weights [1e+308, 1e+308, 1] sum to more than a float holds: scale them down (only their ratios count)"),
    ({'books': 1e308, 'code': 1e308}, "weights [1e+308, 1e+308, 0] sum to more than a float holds")])
def test_weights_that_are_not_numbers_or_overflow_are_named(root, weights, msg):
    with pytest.raises(ValueError) as e: StreamingLoader(root, 8, 2, weights=weights)
    assert msg in str(e.value)


def test_missing_root_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match='does not exist'): StreamingLoader(tmp_path/'nowhere', 8, 2)


def test_close_stops_the_thread(root):
    before = {t.name for t in threading.enumerate()}
    ld = StreamingLoader(root, 8, 2, prefetch=2, n_logical_shards=4)
    next(ld)
    assert any(t.name == 'nanochat_dl-stream' for t in threading.enumerate())
    ld.close()
    assert not [t for t in threading.enumerate() if t.name == 'nanochat_dl-stream' and t.name not in before]
    with pytest.raises(RuntimeError, match='closed'): next(ld)


def test_load_after_start_is_refused(root):
    with StreamingLoader(root, 8, 2, prefetch=0, n_logical_shards=4) as ld:
        sd = ld.state_dict(); next(ld)
        with pytest.raises(RuntimeError, match='before the first batch'): ld.load_state_dict(sd)
