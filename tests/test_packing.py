"""Property tests for nanochat_dl.pipe.packing: the fast packer equals nanochat's reference loop on any stream,
every strategy keeps the packing invariants, the buffer state round-trips, attention metadata rebuilds
every piece, and bad input is refused with a message that names it."""
import contextlib, io, json
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nanochat_dl.pipe.packing import STRATEGIES, ReferencePacker, ListPull, Segment, FlatDocs
from nanochat_dl.pipe.bestfit import Packer
from nanochat_dl.pipe.masks import cu_seqlens, position_ids, pad_mask
from nanochat_dl.bench.pack import bench_pack_cli

BOS = 0
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Stream:
    """An endless pull that cycles through drawn lengths and pull sizes; documents are random tokens after BOS, keys count up.
    `as_list`: False (numpy arrays), True (Python lists) or 'flat' (one `FlatDocs`, as a tokenizer worker answers)."""
    def __init__(self, lengths, pull_sizes, seed=0, as_list=False):
        assert any(pull_sizes)
        self.lengths, self.pull_sizes, self.as_list = lengths, pull_sizes, as_list
        self.rng, self.docs, self.n_pulls = np.random.default_rng(seed), {}, 0

    def __call__(self):
        n = self.pull_sizes[self.n_pulls % len(self.pull_sizes)]
        self.n_pulls += 1
        keys = list(range(len(self.docs), len(self.docs) + n))
        for k in keys:
            d = self.rng.integers(1, 500, self.lengths[k % len(self.lengths)])
            d[0] = BOS
            self.docs[k] = d
        docs = [self.docs[k] for k in keys]
        if self.as_list == 'flat':
            return FlatDocs([len(d) for d in docs], np.concatenate(docs).astype(np.int32) if docs else np.empty(0, np.int32)), keys
        return ([d.tolist() for d in docs] if self.as_list else docs), keys

    def doc(self, key): return self.docs[key]


class Tee:
    "Record pulls so that a second packer can replay them."
    def __init__(self, pull): self.pull, self.log = pull, []
    def __call__(self):
        got = self.pull(); self.log.append(got); return got
    def replay(self): return self.log.pop(0)


def same(a, b):
    assert np.array_equal(a.rows, b.rows)
    assert a.segments == b.segments
    assert a.metrics == b.metrics


@st.composite
def streams(draw, max_T=20):
    T = draw(st.integers(1, max_T))
    lengths = draw(st.lists(st.integers(1, 4 * (T + 1)), min_size=1, max_size=40))
    pull_sizes = draw(st.lists(st.integers(0, 10), min_size=1, max_size=6).filter(any))
    return dict(T=T, lengths=lengths, pull_sizes=pull_sizes, seed=draw(st.integers(0, 2**16)),
                buffer_size=draw(st.integers(1, 50)), B=draw(st.integers(1, 4)), batches=draw(st.integers(1, 5)),
                as_list=draw(st.sampled_from([False, True, 'flat'])))


@SETTINGS
@given(streams())
def test_fast_equals_reference(s):
    ref, fast = ReferencePacker(s['T'], s['buffer_size'], bos_id=BOS), Packer(s['T'], s['buffer_size'], bos_id=BOS)
    p1 = Stream(s['lengths'], s['pull_sizes'], s['seed'], s['as_list'])
    p2 = Stream(s['lengths'], s['pull_sizes'], s['seed'], s['as_list'])
    for _ in range(s['batches']):
        same(ref.next_batch(s['B'], p1), fast.next_batch(s['B'], p2))
        assert ref.buffer_state() == fast.buffer_state()
        assert ref.buffered_tokens == fast.buffered_tokens


def check(packer, batch, doc_of, seen):
    "The packing invariants of one batch; `seen` accumulates (key, offset) across batches."
    B, C = batch.rows.shape
    assert C == packer.T + 1 and batch.rows.dtype == np.int64
    strategy = packer.strategy
    for r, segs in enumerate(batch.segments):
        pos = 0
        for s in segs:
            assert s.start == pos and s.length >= 1
            piece = packer.piece(doc_of(s.key), s.offset) if isinstance(packer, Packer) else doc_of(s.key)
            if strategy == 'concat': assert s.dropped == 0 and (s.length == len(piece) or s.start + s.length == C)
            else: assert s.length + s.dropped == len(piece)
            assert np.array_equal(batch.rows[r, s.start:s.start + s.length], np.asarray(piece)[:s.length])
            if s.dropped: assert s.start + s.length == C
            if s.offset == 0: assert np.array_equal(piece[:s.length], doc_of(s.key)[:s.length])   # a prefix of the document
            assert (s.key, s.offset) not in seen
            seen.add((s.key, s.offset))
            pos += s.length
        if pos < C:
            assert strategy == 'bestfit-pad' or packer.max_docs_per_row is not None
            assert (batch.rows[r, pos:] == packer.pad_id).all()
        if strategy != 'concat': assert batch.rows[r, 0] == BOS
    m, t = batch.metrics, packer.metrics_state()
    assert m['tokens_emitted'] == B * C
    assert m['tokens_padded'] == int(pad_mask(batch).sum())
    assert m['tokens_cropped'] == sum(s.dropped for segs in batch.segments for s in segs)
    assert t['tokens_in'] == t['emitted'] - t['padded'] + t['cropped'] + packer.buffered_tokens
    assert m['total_tokens_in'] == m['total_emitted'] - m['total_padded'] + m['total_cropped'] + m['buffered_tokens']
    if strategy == 'bestfit-crop' and getattr(packer, 'max_docs_per_row', None) is None: assert m['tokens_padded'] == 0


@SETTINGS
@given(streams(), st.sampled_from(list(STRATEGIES)), st.one_of(st.none(), st.integers(1, 4)))
def test_invariants(s, strategy, cap):
    p = Packer(s['T'], s['buffer_size'], strategy, bos_id=BOS, max_docs_per_row=cap)
    stream, seen = Stream(s['lengths'], s['pull_sizes'], s['seed'], s['as_list']), set()
    for _ in range(s['batches']):
        b = p.next_batch(s['B'], stream)
        check(p, b, stream.doc, seen)
        if cap: assert max(map(len, b.segments)) <= cap


@SETTINGS
@given(streams(max_T=12), st.sampled_from(['reference'] + list(STRATEGIES)), st.integers(0, 4))
def test_resume_round_trip(s, strategy, before):
    make = ((lambda: ReferencePacker(s['T'], s['buffer_size'], bos_id=BOS)) if strategy == 'reference'
            else (lambda: Packer(s['T'], s['buffer_size'], strategy, bos_id=BOS)))
    stream = Stream(s['lengths'], s['pull_sizes'], s['seed'])
    a = make()
    for _ in range(before): a.next_batch(s['B'], stream)
    state = json.loads(json.dumps(a.state_dict()))
    b = make()
    b.load_state_dict(state, lambda keys: [stream.doc(k) for k in keys])
    assert b.buffer_state() == a.buffer_state()
    tee = Tee(stream)
    for _ in range(3):
        same(a.next_batch(s['B'], tee), b.next_batch(s['B'], tee.replay))
        assert tee.log == [] and a.buffer_state() == b.buffer_state()


@SETTINGS
@given(streams(max_T=16), st.sampled_from(list(STRATEGIES)), st.one_of(st.none(), st.integers(1, 3)))
def test_cu_seqlens_rebuild_every_piece(s, strategy, cap):
    p = Packer(s['T'], s['buffer_size'], strategy, bos_id=BOS, max_docs_per_row=cap)
    stream = Stream(s['lengths'], s['pull_sizes'], s['seed'])
    max_seqs = s['B'] * ((s['T'] + 1) if cap is None else cap + 1)
    for _ in range(s['batches']):
        b = p.next_batch(s['B'], stream)
        for full in (False, True):
            x = b.rows if full else b.inputs
            W = x.shape[1]
            cs, pos, flat = cu_seqlens(b, max_seqs, full), position_ids(b, full).ravel(), x.ravel()
            assert cs.cu_seqlens.shape == (max_seqs + 1,) and cs.cu_seqlens.dtype == np.int32
            assert (cs.cu_seqlens[cs.n_seqs:] == x.size).all()
            expected = []
            for segs in b.segments:
                for seg in segs:
                    if seg.start < W: expected.append(p.piece(stream.doc(seg.key), seg.offset)[:min(seg.length, W - seg.start)])
                end = segs[-1].start + segs[-1].length
                if end < W: expected.append(np.full(W - end, p.pad_id))
            assert cs.n_seqs == len(expected)
            for i, toks in enumerate(expected):
                lo, hi = cs.cu_seqlens[i], cs.cu_seqlens[i + 1]
                assert np.array_equal(flat[lo:hi], toks)
                assert np.array_equal(pos[lo:hi], np.arange(hi - lo))
            assert cs.max_seqlen == max(map(len, expected))


@SETTINGS
@given(st.integers(1, 15), st.lists(st.integers(1, 80), min_size=1, max_size=20), st.integers(1, 20), st.integers(0, 999))
def test_split_pieces_concatenate_back(T, lengths, buffer_size, seed):
    p, stream, parts = Packer(T, buffer_size, 'bestfit-split', bos_id=BOS), Stream(lengths, [3], seed), {}
    for _ in range(8):
        b = p.next_batch(2, stream)
        for r, segs in enumerate(b.segments):
            for s in segs:
                toks = b.rows[r, s.start:s.start + s.length]
                if s.offset: assert toks[0] == BOS   # every continuation piece starts with BOS
                parts.setdefault(s.key, {})[s.offset] = (toks if s.offset == 0 else toks[1:], s.dropped)
    for key, pieces in parts.items():
        doc = stream.doc(key)
        if set(pieces) == {0} | set(range(T + 1, len(doc), T)) and not any(d for _, d in pieces.values()):
            assert np.array_equal(np.concatenate([pieces[o][0] for o in sorted(pieces)]), doc)


def test_nanochat_small_example():
    docs = [[0] + [ord(c[0])] * (int(c[1:]) - 1) for c in "A4 B3 C6 D2 E5 F11 G5 H7 I3 J6 K2 L4 M3 N2 O5 P8".split()]
    for packer in (ReferencePacker(7, 4, bos_id=0), Packer(7, 4, bos_id=0)):
        b = packer.next_batch(4, ListPull(docs, batch_size=4))
        assert [''.join('B' if t == 0 else chr(t) for t in r) for r in b.rows] == ['BCCCCCBD', 'BHHHHHHB', 'BEEEEBII', 'BJJJJJBK']
        assert b.segments[1] == [Segment(0, 7, 7, 0, 0), Segment(7, 1, 1, 0, 2)]
        assert packer.buffer_state() == [[0, 0], [5, 0], [6, 0], [11, 0]]


@pytest.mark.parametrize('make, message', [
    (lambda: Packer(0), 'T=0 is invalid: expected an int >= 1'),
    (lambda: ReferencePacker(-3), 'T=-3 is invalid'),
    (lambda: Packer(8, buffer_size=0), 'buffer_size=0 is invalid: expected an int >= 1'),
    (lambda: ReferencePacker(8, buffer_size=1.5), 'buffer_size=1.5 is invalid'),
    (lambda: Packer(8, strategy='best-fit'), "unknown strategy 'best-fit'"),
    (lambda: Packer(8, strategy='bestfit-split'), "'bestfit-split' needs bos_id"),
    (lambda: Packer(8, max_docs_per_row=0), 'max_docs_per_row=0 is invalid'),
    (lambda: Packer(8).next_batch(0, ListPull([[0]])), 'B=0 is invalid'),
    (lambda: Packer(8, 2).next_batch(1, ListPull([[0, 1], []])), 'document 1 is empty'),
    (lambda: ReferencePacker(8, 2).next_batch(1, lambda: ([[0], []], ['a', 'b'])), "document 'b' is empty"),
    (lambda: Packer(8, 2, bos_id=0).next_batch(1, ListPull([[0, 1], np.array([7, 1])])), 'document 1 starts with token 7, not bos_id=0'),
    (lambda: ReferencePacker(8, 2, bos_id=3).next_batch(1, lambda: ([[3], [4]], [['f', 0, 1], ['f', 0, 2]])),
     "document ['f', 0, 2] starts with token 4, not bos_id=3"),
    (lambda: Packer(8).next_batch(1, lambda: ([[0]], [1, 2])), 'returned 1 documents but 2 keys'),
    (lambda: Packer(8).next_batch(1, lambda: None), 'must return a pair (docs, keys), got NoneType'),
    (lambda: Packer(8).restore([([0, 1], 'k', 2)]), 'offset=2 is not where a buffer entry can start'),
    (lambda: cu_seqlens(Packer(3, 1).next_batch(1, ListPull([[0]], cycle=True)), max_seqs=2), 'the batch has 3 segments, more than max_seqs=2'),
])
def test_bad_input_is_named(make, message):
    with pytest.raises((ValueError, TypeError, RuntimeError)) as e: make()
    assert message in str(e.value), str(e.value)


def test_long_only_stream_does_not_hang():
    "Only over-long documents: every strategy still makes rows (bestfit-crop crops the shortest, the others give each a row)."
    for strategy in STRATEGIES:
        extra = {'bos_id': 0} if strategy == 'bestfit-split' else {}
        p = Packer(4, 3, strategy, **extra)
        b = p.next_batch(5, ListPull([[0] + [9] * 20] * 1000))
        assert b.rows.shape == (5, 5) and b.metrics['tokens_padded'] == 0


def test_bench_cli_through_the_command_router():
    from nanochat_dl.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(['bench-pack', '-b', '16', '--t', '128', '--buffer-size', '10', '--batches', '20', '--seed', '1'])
    assert rc == 0, out.getvalue()
    text = out.getvalue()
    assert 'B=16 T=128 buffer_size=10' in text and 'n/a' not in text and 'identical rows, segments and buffers: True' in text
    assert 'reference (nanochat loop)' in text and 'fast, numpy documents' in text


@SETTINGS
@given(streams())
def test_out_array_receives_the_same_rows(s):
    for make in (lambda: ReferencePacker(s['T'], s['buffer_size'], bos_id=BOS), lambda: Packer(s['T'], s['buffer_size'], bos_id=BOS)):
        a, b = make(), make()
        p1 = Stream(s['lengths'], s['pull_sizes'], s['seed'])
        p2 = Stream(s['lengths'], s['pull_sizes'], s['seed'])
        order = 'F' if s['seed'] % 2 else 'C'    # a column-major `out` takes the packer's other write path
        out = np.full((s['B'], s['T'] + 1), -1, dtype=np.int64, order=order)
        x, y = a.next_batch(s['B'], p1), b.next_batch(s['B'], p2, out=out)
        assert y.rows is out and np.array_equal(x.rows, out) and x.segments == y.segments
