"""Issue 18 item 1 for the pre-tokenized loader (nbs/tokens/12i_loader.ipynb): an epoch ends. Contract: on one rank's stream,
every non-empty document of a dataset's epoch e is delivered (whole, or all its pieces) before any token of that
dataset's epoch e+2. Counted from `batch.segments` (document, epoch, length)."""
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.tokens.root import TokenRoot
from nanochat_dl.tokens.meta import write_counts
from nanochat_dl.tokens.files import write_token_file
from nanochat_dl.text.lengths import fineweb_like_lengths
from nanochat_dl.tokens import StreamingLoader
from nanochat_dl.pipe import seal
from test_streaming import toy_root

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def late_documents(loader, lens, steps):
    "Run `steps` batches; the `(dataset, file, doc, epoch)` left incomplete when a token of epoch + 2 of its dataset came."
    got, late, top = Counter(), set(), {}
    for _ in range(steps):
        b = next(loader)
        for row in b.segments:
            for s in row:
                k = s.key
                if k.epoch > top.get(k.dataset, 0):
                    top[k.dataset] = k.epoch
                    e = k.epoch - 2                  # every document of epoch e must be whole by now (epochs count from 1)
                    if e >= 1: late |= {(d, f, i, e) for (d, f, i), L in lens.items() if d == k.dataset and L and got[(d, f, i, e)] < L}
                got[(k.dataset, k.file, k.doc, k.epoch)] += s.length
    loader.close()
    return late


@pytest.fixture(scope='module')
def small(tmp_path_factory):
    r = toy_root(tmp_path_factory.mktemp('ends')/'root', {'web': {'a.arrow': 210}}, empty=0.05)
    tr = TokenRoot(r)
    return r, {('web', 'a.arrow', i): L for i, L in enumerate(tr.open('web', 'a.arrow').lens.tolist())}


# Defect reproductions (issue 18 item 1): each failed before its fix.
@pytest.mark.parametrize('pack_buffer', [1000, 64])
def test_pack_buffer_lets_no_document_wait_past_two_epochs(small, pack_buffer):
    r, lens = small
    ld = StreamingLoader(r, 64, 4, rank=0, world_size=1, n_logical_shards=8, shuffle_window=0, pack='bestfit',
                         pack_buffer=pack_buffer, prefetch=0)
    assert late_documents(ld, lens, 400) == set()


def test_shuffle_window_lets_no_document_wait_past_two_epochs(small):
    r, lens = small
    ld = StreamingLoader(r, 64, 4, rank=0, world_size=1, n_logical_shards=8, shuffle_window=40, pack='concat', prefetch=0)
    assert late_documents(ld, lens, 1500) == set()


def two_datasets(path, n=3000, means=(200, 40)):
    "Datasets 'a' (long documents) and 'b' (short ones), `n` documents each; token = uid << 12 | position."
    rng, c, uid = np.random.default_rng(0), {}, 1
    for ds, mean in zip('ab', means):
        L = fineweb_like_lengths(n, rng, mean=mean, T=64)
        c[(ds, 'x.arrow')] = write_token_file(Path(path)/ds/'x.arrow', [(np.int64(uid + i) << 12) | (np.arange(l) & 0xFFF) for i, l in enumerate(L)])
        uid += n
    write_counts(path, c)
    return Path(path)


def test_delivered_shares_stay_within_a_point_of_the_weights(tmp_path):
    "bestfit + max_chunk, weights 0.375/0.625: the delivered share of 'a' over any 400 batches is within 1 point of 0.375 (before: 0.377 to 0.394, failing)."
    r = two_datasets(tmp_path/'root')
    ld = StreamingLoader(r, 64, 32, rank=0, world_size=1, n_logical_shards=8, weights={'a': 0.375, 'b': 0.625}, pack='bestfit',
                         max_chunk=100, shuffle_window=100, prefetch=0)
    a, tot = [0], [0]
    for _ in range(600):
        b = next(ld)
        n = Counter()
        for row in b.segments:
            for s in row: n[s.key.dataset] += s.length
        a.append(a[-1] + n['a']); tot.append(tot[-1] + n['a'] + n['b'])
    m = b.metrics
    ld.close()
    a, tot = np.array(a), np.array(tot)
    share = (a[400:] - a[:-400]) / (tot[400:] - tot[:-400])
    assert np.abs(share - 0.375).max() < 0.01, (share.min(), share.max())
    assert abs(m['delivered_shares']['a'] - a[-1] / tot[-1]) < 1e-9            # the metric counts what the rows hold
    assert abs(m['total_shares']['a'] - 0.375) < 1e-3                           # what the mixer took in
    assert m['oldest_wait'] >= 0


@pytest.mark.parametrize('kw', [dict(pack='bestfit', max_chunk=30, shuffle_window=20, pack_buffer=200),
                                dict(pack='pad', shuffle_window=7), dict(pack='concat', max_chunk=16, shuffle_window=30),
                                dict(pack='bestfit', pack_buffer=5000, shuffle_window=0)])
def test_mixed_datasets_end_their_epochs(tmp_path, kw):
    "Two datasets of 150 and 40 documents, every mode: no document of epoch e is whole only after epoch e+2 began (before: 688, 0, 3, 5334 late)."
    r = toy_root(tmp_path/'root', {'web': {'a.arrow': 150}, 'code': {'x.arrow': 40}}, empty=0.05)
    tr = TokenRoot(r)
    lens = {(d, f.file, i): L for d in tr.datasets for f in tr.files[d] for i, L in enumerate(tr.open(d, f.file).lens.tolist())}
    ld = StreamingLoader(r, 64, 4, rank=0, world_size=1, n_logical_shards=8, prefetch=0, **kw)
    assert late_documents(ld, lens, 600) == set()


# ---------------------------------------------------------------- across rescales: a rank handed shards of different epochs

from nanochat_dl.tokens import DocKey, owned_shards, shard_starts


class Ledger:
    "Document tokens delivered per `(dataset, file, doc, epoch)` over a whole chain of worlds, and the pieces (`cov`, for `assert_tiles`)."
    def __init__(self, tr, S):
        self.tr, self.S, self.got, self.cov = tr, S, Counter(), {}
        self.docs = {d: [(fi.file, i, L) for fi in tr.files[d] for i, L in enumerate(tr.open(d, fi.file).lens.tolist())] for d in tr.datasets}

    def owned(self, rank, W) -> dict:
        "Per dataset, the `(file, doc, length)` of the documents in the logical shards of `rank` of `W`."
        out = {}
        for d, docs in self.docs.items():
            b, own = shard_starts(len(docs), self.S), owned_shards(self.S, rank, W)
            out[d] = docs[b[own.start]:b[own.stop]]
        return out

    def run(self, ld, n, rank, W) -> set:
        "Take `n` batches of `ld` (rank `rank` of `W`); the `(dataset, file, doc, epoch)` of its documents still incomplete when a token of epoch + 2 came."
        own, top, late = self.owned(rank, W), {}, set()
        for _ in range(n):
            b = self.last = next(ld)
            for r, row in enumerate(b.segments):
                for s in row:
                    k = s.key
                    assert np.array_equal(b.rows[r, s.start:s.start + s.length], self.tr.doc(k.dataset, k.file, k.doc)[s.offset:s.offset + s.length])
                    if k.epoch > top.get(k.dataset, 0):
                        top[k.dataset] = k.epoch
                        late |= {(k.dataset, f, i, e) for f, i, L in own[k.dataset] if L for e in range(1, k.epoch - 1)
                                 if self.got[(k.dataset, f, i, e)] < L}
                    self.got[(k.dataset, k.file, k.doc, k.epoch)] += s.length
                    self.cov.setdefault(k, []).append((s.offset, s.length))
        return late


def long_then_short(path, n=40, long=40, short=4):
    "One dataset 'web': documents 0..n/2-1 of about `long` tokens, the rest of about `short` (the first two of four shards take long to walk)."
    rng = np.random.default_rng(1)
    L = [int(x) for x in np.r_[rng.integers(long // 2, 2 * long, n // 2), rng.integers(1, 2 * short, n - n // 2)]]
    c = {('web', 'a.arrow'): write_token_file(Path(path)/'web'/'a.arrow', [(np.int64(1 + i) << 12) | np.arange(l) for i, l in enumerate(L)])}
    write_counts(path, c)
    return Path(path)


def drifted(tmp_path, kw):
    "Two ranks run apart (rank 1's documents are short: it walks its shards ~10x faster), each checked; their states, and a ledger."
    r = long_then_short(tmp_path/'root')
    tr, S = TokenRoot(r), 4
    led, mk = Ledger(tr, S), lambda rank, W: StreamingLoader(tr, 16, 2, rank=rank, world_size=W, n_logical_shards=S, prefetch=0, **kw)
    two = [mk(rank, 2) for rank in range(2)]
    for rank, ld in enumerate(two): assert led.run(ld, 31, rank, 2) == set()
    states = [ld.state_dict() for ld in two]
    eps = [min(runs(s['datasets']['web']['epoch'])) for s in states]
    assert eps[1] >= eps[0] + 2, eps                                          # the ranks are epochs apart
    return led, mk(0, 1).load_state_dict(states), states


DRIFT = [dict(pack='concat', shuffle_window=0), dict(pack='bestfit', shuffle_window=3, max_chunk=9, pack_buffer=4), dict(pack='pad', shuffle_window=0)]


@pytest.mark.parametrize('kw', DRIFT)
def test_a_rescale_joining_ranks_apart_by_epochs_keeps_the_contract(tmp_path, kw):
    "2 -> 1 rank after the ranks drifted apart: the one rank delivers the old epochs of rank 0's shards before any token two epochs later. Before: rank 1's shards went on at once, and the pieces rank 1's buffers held came out first (epoch 14 before epoch 2 ended)."
    led, one, states = drifted(tmp_path, kw)
    parked = one.state_dict()['datasets']['web'].get('parked', [])
    assert parked and min(e for _, e, _ in parked) >= 4                      # rank 1's buffered pieces wait, parked
    for _ in range(60):                                                      # until they are all out
        assert led.run(one, 50, 0, 1) == set()
        if 'parked' not in one.state_dict()['datasets']['web']: break
    else: raise AssertionError('parked pieces never went')
    assert_tiles_to(led, 1)


def assert_tiles_to(led, epochs):
    "Every non-empty document of epochs 1..`epochs` delivered exactly once (the pieces of its ledger tile it)."
    for d, docs in led.docs.items():
        for f, i, L in docs:
            for e in range(1, epochs + 1):
                ps, at = sorted(led.cov.get(DocKey(d, f, i, e), [])), 0
                for off, n in ps: assert off == at, (d, f, i, e, ps, L); at += n
                assert at == L, (d, f, i, e, ps, L)


def runs(rle): return [v for v, c in rle for _ in range(c)]


def test_hand_edited_epochs_two_apart_on_one_rank(tmp_path):
    "A state whose shards are at epochs 1 and 3 (rank 1's edited two epochs on, as if it had drifted): the epoch-1 documents all come before a token of epoch 3."
    r = toy_root(tmp_path/'root', {'web': {'a.arrow': 60}}, empty=0.1)
    tr, S = TokenRoot(r), 6
    two = [StreamingLoader(tr, 16, 2, rank=rank, world_size=2, n_logical_shards=S, prefetch=0, shuffle_window=0) for rank in range(2)]
    for ld in two:
        for _ in range(3): next(ld)
    states = [ld.state_dict() for ld in two]
    d = states[1]['datasets']['web']
    assert runs(d['epoch']) == [1, 1, 1]
    d['epoch'], d['draws'] = [[3, 3]], d['draws'] + 2 * 30                   # its 30 documents drawn twice more
    seal(states[1])                                                           # (as its loader would have handed it out)
    ld = StreamingLoader(tr, 16, 2, rank=0, world_size=1, n_logical_shards=S, prefetch=0, shuffle_window=0).load_state_dict(states)
    seen = []
    for _ in range(200):
        seen += [s.key.epoch for row in next(ld).segments for s in row]
    first3 = seen.index(3)
    assert 1 not in seen[first3:] and 1 in seen[:first3], (first3, seen[:first3].count(1))


# ---------------------------------------------------------------- max_wait, a setting of the loader

from nanochat_dl.pipe.bestfit import MAX_WAIT


def oldest_waits(r, n=300, **kw):
    ld = StreamingLoader(r, 64, 8, rank=0, world_size=1, n_logical_shards=8, shuffle_window=0, pack='bestfit', pack_buffer=200, prefetch=0, **kw)
    out = [(next(ld).metrics['oldest_wait']) for _ in range(n)]
    assert ld.stream.packer.max_wait == kw.get('max_wait', MAX_WAIT)
    ld.close()
    return out


def test_max_wait_bounds_the_wait_it_is_given(tmp_path):
    "3,000 documents, a buffer of 200 pieces: the oldest wait over 300 batches of 8 rows falls with `max_wait` (None: 1,805 rows; 256: 301; 16: 207)."
    r = toy_root(tmp_path/'root', {'web': {'a.arrow': 3000}}, empty=0.0)
    none, default, small = (max(oldest_waits(r, **kw)) for kw in (dict(max_wait=None), {}, dict(max_wait=16)))
    assert none > default > small and default < MAX_WAIT + 64, (none, default, small)


def test_max_wait_is_part_of_the_state(small):
    r, _ = small
    kw = dict(rank=0, world_size=1, n_logical_shards=8, shuffle_window=5, pack='bestfit', pack_buffer=16, prefetch=0)
    ld = StreamingLoader(r, 64, 4, max_wait=3, **kw)
    bs = [next(ld) for _ in range(6)]
    st = bs[2].state
    assert st['config']['max_wait'] == 3
    with pytest.raises(ValueError, match=r"saved with max_wait=3, this loader has max_wait=256: exact resume needs the same max_wait"):
        StreamingLoader(r, 64, 4, **kw).load_state_dict(st)
    again = StreamingLoader(r, 64, 4, max_wait=3, **kw).load_state_dict(st)
    assert all(np.array_equal(next(again).rows, b.rows) for b in bs[3:])
    # a state saved before max_wait was a setting (no such key) was made with the default: it loads where max_wait is the default
    d = StreamingLoader(r, 64, 4, **kw)
    bs = [next(d) for _ in range(4)]
    old = json.loads(json.dumps(bs[1].state)); del old['config']['max_wait'], old['checksum']
    old['format'] = 'nanochat_dl.streaming/2'                                   # (as such a state was)
    assert np.array_equal(next(StreamingLoader(r, 64, 4, **kw).load_state_dict(old)).rows, bs[2].rows)
    with pytest.raises(ValueError, match="max_wait"): StreamingLoader(r, 64, 4, max_wait=None, **kw).load_state_dict(old)
    with pytest.raises(ValueError, match=r"max_wait=-1 is invalid"): StreamingLoader(r, 64, 4, max_wait=-1, **kw)


# ---------------------------------------------------------------- the contract as a property: lengths, packs, buffers, windows, mixes, rescale chains

import tempfile
from hypothesis import HealthCheck, given, settings, strategies as st
from nanochat_dl.tokens import PACKS, open_epochs

CHAINS = [(3, 5, 2), (1, 4, 3), (2, 1), (1,)]


def write_lengths(path, spec, S):
    "Datasets `{name: lengths}` as one token file each (token = uid << 12 | position); each of the `S` logical shards starts with a non-empty document."
    c, uid = {}, 1
    for ds, L in spec.items():
        L = list(L)
        for b in shard_starts(len(L), S)[:-1]: L[b] = max(L[b], 1)        # every rank of any world owns a token
        c[(ds, 'a.arrow')] = write_token_file(Path(path)/ds/'a.arrow', [(np.int64(uid + i) << 12) | np.arange(l) for i, l in enumerate(L)])
        uid += len(L)
    write_counts(path, c)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(T=st.sampled_from([3, 8]), data=st.data(), pack=st.sampled_from(list(PACKS)), max_chunk=st.sampled_from([None, 2, 5]),
       window=st.sampled_from([0, 2, 5]), pack_buffer=st.sampled_from([1, 3, 40]), two=st.booleans(), weights=st.sampled_from([(1, 1), (1, 3), (4, 1)]),
       chain=st.sampled_from(CHAINS), steps=st.lists(st.integers(0, 9).map(lambda k: 2 * k + 1), min_size=3, max_size=3), seed=st.integers(0, 2),
       delims=st.sampled_from([{}, dict(bos_token=1), dict(bos_token=1, eos_token=2)]))
def test_epochs_end_over_chains_hypothesis(T, data, pack, max_chunk, window, pack_buffer, two, weights, chain, steps, seed, delims):
    """On every rank of every world of a chain (states of every rank saved after an odd number of batches, loaded as a list at
    the next world size), no token of a dataset's epoch e+2 comes while a non-empty document of its epoch e in that rank's
    shards is not whole; the last world runs until epochs 1 and 2 are closed on every rank, and every document of both
    epochs was delivered exactly once."""
    S = 6
    lens = st.lists(st.integers(0, 3 * T + 2), min_size=S, max_size=14)
    spec = {'web': data.draw(lens, 'web')}
    if two: spec['code'] = data.draw(lens, 'code')
    with tempfile.TemporaryDirectory() as tmp:
        write_lengths(tmp, spec, S)
        tr = TokenRoot(tmp)
        kw = dict(n_logical_shards=S, pack=pack, max_chunk=max_chunk, shuffle_window=window, pack_buffer=pack_buffer, seed=seed, prefetch=0,
                  weights=list(weights[:len(spec)]), datasets=list(spec), **delims)
        led, states = Ledger(tr, S), None
        for j, W in enumerate(chain):
            units = [StreamingLoader(tr, T, 2, rank=r, world_size=W, **kw) for r in range(W)]
            for r, ld in enumerate(units):
                if states is not None: ld.load_state_dict(states)
                if j < len(chain) - 1: assert led.run(ld, steps[j], r, W) == set(), (j, r)
                else:
                    for k in range(2000):
                        if min(open_epochs(ld.state_dict()).values()) > 2: break
                        assert led.run(ld, 1, r, W) == set(), (j, r, k)
                    else: raise AssertionError('epoch 2 never closed')
            states = [ld.state_dict() for ld in units]
            for ld in units: ld.close()
        assert_tiles_to(led, 2)


# ---------------------------------------------------------------- parked pieces: exact resume, rescaled again, refused when impossible

from nanochat_dl.tokens import FastTokenStream, TokenStream


@pytest.mark.parametrize('kw', DRIFT[:2])
def test_parked_pieces_resume_exactly_and_rescale_again(tmp_path, kw):
    led, one, _ = drifted(tmp_path, kw)
    got = []
    for _ in range(12):
        assert led.run(one, 1, 0, 1) == set()
        got.append((led.last.rows.copy(), json.loads(json.dumps(one.state_dict()))))
    assert 'parked' in got[5][1]['datasets']['web']
    for k in (0, 5):                                                   # a loader resumed from a state with parked pieces
        ld = StreamingLoader(led.tr, 16, 2, rank=0, world_size=1, n_logical_shards=4, prefetch=0, **kw).load_state_dict(got[k][1])
        assert all(np.array_equal(next(ld).rows, r) and ld.state_dict() == s for r, s in got[k + 1:])
        # the reference stream makes the same rows from it
        a, b = (cls(led.tr, ld.config).load_state(got[k][1]) for cls in (TokenStream, FastTokenStream))
        assert all(np.array_equal(a.next_rows(2).rows, b.next_rows(2).rows) for _ in range(8))
    # rescaled again (1 -> 3) while pieces are parked: the contract holds, and every document of epochs 1 to 4 came once
    three = [StreamingLoader(led.tr, 16, 2, rank=r, world_size=3, n_logical_shards=4, prefetch=0, **kw).load_state_dict([got[-1][1]]) for r in range(3)]
    assert not any('parked' in ld.state_dict()['datasets']['web'] for ld in three)   # rank 2 owns their shards alone: the packer's again
    for r, ld in enumerate(three):
        for _ in range(200):
            if min(open_epochs(ld.state_dict()).values()) > 4: break
            assert led.run(ld, 5, r, 3) == set()
        else: raise AssertionError('epoch 4 never closed')
    assert_tiles_to(led, 4)


def test_impossible_parked_pieces_are_refused(tmp_path):
    led, one, _ = drifted(tmp_path, DRIFT[0])
    st = one.state_dict()
    mk = lambda: StreamingLoader(led.tr, 16, 2, rank=0, world_size=1, n_logical_shards=4, prefetch=0, **DRIFT[0])
    d = st['datasets']['web']
    g, e, a = d['parked'][0]
    for parked, msg in [([[g, e, a], [g, e, a]], "would be delivered twice"),
                        ([[g, 99, a]], r"\['parked'\]\[0\]: epoch 99, but logical shard"),
                        ([[g, e, 10**6]], r"\['parked'\]\[0\]: start 1000000 is not where a piece"),
                        ([[g, e]], r"\['parked'\]\[0\]=\[.*expected \[doc, epoch, start\]"),
                        ({}, r"\['parked'\] must be a list")]:
        bad = json.loads(json.dumps(st)); bad['datasets']['web']['parked'] = parked
        with pytest.raises(ValueError, match=msg): mk().load_state_dict(bad)
    dup = json.loads(json.dumps(st)); dup['packer']['entries'].append([0, g, e, a, 0])
    with pytest.raises(ValueError, match="parked.*would be delivered twice|would be delivered twice"): mk().load_state_dict(dup)


def test_a_state_of_format_2_still_loads(small):
    "A state written before max_wait and parked pieces (format /2, no 'max_wait' in its config) resumes exactly where max_wait is the default."
    r, _ = small
    kw = dict(rank=0, world_size=1, n_logical_shards=8, shuffle_window=5, pack='bestfit', pack_buffer=16, prefetch=0)
    ld = StreamingLoader(r, 64, 4, **kw, shuffle='reservoir')      # (the window of every state before /4)
    bs = [next(ld) for _ in range(5)]
    old = json.loads(json.dumps(bs[1].state))
    assert old['format'] == 'nanochat_dl.streaming/6'
    old['format'] = 'nanochat_dl.streaming/2'; del old['config']['max_wait']
    again = StreamingLoader(r, 64, 4, **kw).load_state_dict(old)
    assert all(np.array_equal(next(again).rows, b.rows) for b in bs[2:])
