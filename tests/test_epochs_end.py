"""Epochs end (issue 18, item 1) for the text loader's packers `bestfit-pad` and `bestfit-split`: every non-empty document
of epoch e is delivered (all its pieces) before any token of epoch e+2, on each rank's stream, across exact resumes and
rescales (the list of every rank's state at another world size). Tokens are attributed by the batches' segments."""
import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nanochat_dl.text.loader import PackedLoader
from toytext import toy_text_env

LAYOUT = [[3, 2, 4, 1, 3, 2], [2, 3, 1, 4, 2], [4, 1, 2, 3, 2, 1]]   # 38 documents in 6 columns
KW = dict(batch_size=2, seq_len=32, tokenizer_batch_size=2, device='cpu', tokenizer_threads=1, tokenize_in='threads', prefetch=0)
GUARDED = ('bestfit-pad', 'bestfit-split')


@pytest.fixture(scope='module')
def env(tmp_path_factory): return toy_text_env(tmp_path_factory.mktemp('epochs'), LAYOUT)


def pieces(batch, split):
    "`(epoch, address, lo, hi)` for each segment of `batch`, in delivery order: the range of the document's tokens it stands for."
    for row in batch.segments:
        for s in row:
            k = tuple(s.key)
            yield k[0], k[1:], s.offset, s.offset + s.length + s.dropped - (split and s.offset > 0)


class Ledger:
    """What the streams delivered so far, checked at each segment: every document of epoch e that a stream must deliver is whole
    before that stream delivers a token of epoch e+2 (`owed(e)`: those documents; default: the ones it delivered a piece of)."""
    def __init__(self, lens): self.lens, self.cover = lens, defaultdict(list)
    def whole(self, e, a):
        rs = sorted(self.cover[e, a])
        return bool(rs) and rs[0][0] == 0 and rs[-1][1] == self.lens[a] and all(x[1] == y[0] for x, y in zip(rs, rs[1:]))
    def stream(self, owed=None): return dict(seen=defaultdict(set), started=set(), owed=owed)
    def add(self, s, batch, split, at):
        for e, a, lo, hi in pieces(batch, split):
            if e not in s['started'] and e - 2 >= 1:   # the first token of epoch e on this stream
                owed = s['seen'][e - 2] if s['owed'] is None else s['owed'](e - 2)
                late = [x for x in owed if not self.whole(e - 2, x)]
                assert not late, (f"{at}: the first token of epoch {e} came while {len(late)} documents of epoch {e - 2} "
                                  f"were not yet whole, e.g. {late[:3]}")
            assert e + 2 not in s['started'], f"{at}: a piece of {a} of epoch {e} came after epoch {e + 2} began"
            s['started'].add(e); s['seen'][e].add(a)
            self.cover[e, a].append((lo, hi))


def run_single(env, strategy, buffer_size, n, **kw):
    "One rank, `n` batches: the ledger, checked as it goes (every document of the rank's stream counts)."
    led = Ledger(env['lens']); s = led.stream(lambda e: env['lens'])
    with PackedLoader(env['tok'], files=env['files'], **{**KW, **kw}, pack=strategy, pack_buffer=buffer_size) as ld:
        for i in range(n):
            b = next(ld)
            led.add(s, b, strategy == 'bestfit-split', f"batch {i}")
    return led


@pytest.mark.parametrize('strategy', GUARDED)
def test_epoch_e_is_whole_before_epoch_e_plus_2(env, strategy):
    "The reproduction: a buffer larger than the dataset (64 > 38 documents) held epoch 1's documents past epoch 3's start."
    led = run_single(env, strategy, 64, 120)
    assert max(e for e, _ in led.cover) >= 4   # several epochs went by


# --- the packer alone: any lengths, buffers, age limits, pulls; resumed (bit for bit) at any batch, twice -------------------
from nanochat_dl.pipe.bestfit import GUARDED as PACKER_GUARDED, Packer
from nanochat_dl.pipe.packing import HELD


class CyclePull:
    "Documents of fixed lengths over and over, `n` a pull; keys `(epoch, index)`; its position is two ints (a state)."
    def __init__(self, lengths, n, seed=0, epoch=1, pos=0):
        rng = np.random.default_rng(seed)
        self.docs = [np.concatenate([[0], rng.integers(1, 99, L - 1)]) for L in lengths]
        self.n, self.epoch, self.pos = n, epoch, pos
    def __call__(self):
        if self.pos >= len(self.docs): self.epoch, self.pos = self.epoch + 1, 0
        i = self.pos; self.pos = min(i + self.n, len(self.docs))
        return self.docs[i:self.pos], [(self.epoch, j) for j in range(i, self.pos)]
    def fetch(self, keys): return [self.docs[k[1]] for k in keys]


def packer(strategy, T, size, max_wait):
    return Packer(T, size, strategy, bos_id=0, max_wait=max_wait, epoch_of=lambda k: k[0])


def check_packer_stream(lengths, T, size, n, strategy, max_wait, B, k, cuts):
    "Pack `k` batches; at each batch in `cuts` go on from a state (JSON round trip) in a new packer: the same batches as without."
    lens = {(j,): L for j, L in enumerate(lengths)}
    led, split = Ledger(lens), strategy == 'bestfit-split'
    s = led.stream(lambda e: lens)
    p, pull = packer(strategy, T, size, max_wait), CyclePull(lengths, n)
    q, qpull = packer(strategy, T, size, max_wait), CyclePull(lengths, n)   # resumed at each cut
    for i in range(k):
        if i in cuts:
            state = json.loads(json.dumps(dict(packer=q.state_dict(), pull=[qpull.epoch, qpull.pos])))
            q, qpull = packer(strategy, T, size, max_wait), CyclePull(lengths, n, 0, *state['pull'])
            st_ = state['packer']
            st_['buffer'] = [[tuple(key), off] for key, off in st_['buffer']]
            q.load_state_dict(st_, qpull.fetch)
        a, b = p.next_batch(B, pull), q.next_batch(B, qpull)
        assert np.array_equal(a.rows, b.rows) and a.segments == b.segments and a.metrics == b.metrics, f"batch {i} after a resume"
        if max_wait is not None:   # a piece late by `max_wait` rows goes first, one a row: only those ahead of it delay it more
            assert a.metrics['oldest_wait'] <= max_wait + 1 + 3 * (size + n), a.metrics['oldest_wait']
        led.add(s, a, split, f"batch {i}")
    return led


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(2, 12), data=st.data(), strategy=st.sampled_from(PACKER_GUARDED), size=st.integers(1, 40),
       n=st.integers(1, 9), max_wait=st.one_of(st.none(), st.integers(0, 30)), B=st.integers(1, 3))
def test_packer_epochs_end(T, data, strategy, size, n, max_wait, B):
    lengths = data.draw(st.lists(st.integers(1, 3 * (T + 1)), min_size=1, max_size=25), 'lengths')
    k = 60
    cuts = set(data.draw(st.lists(st.integers(1, k - 1), max_size=2), 'cuts'))
    led = check_packer_stream(lengths, T, size, n, strategy, max_wait, B, k, cuts)
    assert all(led.whole(1, (j,)) for j in range(len(lengths))) or max(e for e, _ in led.cover) <= 2


# --- the loader: world sizes, rescale chains (lists of every rank's state), exact resumes -------------------------------------
def run_chain(env, sizes, ks, strategy, buffer_size, shuffle=False):
    "Stages of `sizes[i]` ranks, `ks[i]` batches each (the last: until epoch 4 begins), each stage resumed from the list of the states of the one before: the ledger, checked."
    led, states, split = Ledger(env['lens']), None, strategy == 'bestfit-split'
    for i, W in enumerate(sizes):
        out = []
        for r in range(W):
            s = led.stream()
            with PackedLoader(env['tok'], files=env['files'], **KW, pack=strategy, pack_buffer=buffer_size, shuffle=shuffle, seed=5,
                              rank=r, world_size=W, resume_state_dict=states) as ld:
                j, final = 0, i == len(sizes) - 1
                while j < ks[i] if not final else max(s['started'], default=0) < 4:
                    b = next(ld); j += 1
                    assert j < 1000, "epoch 4 never began"
                    assert b.metrics['oldest_wait'] >= 0
                    led.add(s, b.packed, split, f"stage {i} (world size {W}), rank {r}, batch {j}")
                out.append(json.loads(json.dumps(ld.state_dict())))
        states = out
    return led


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=3), ks=st.lists(st.integers(0, 25), min_size=3, max_size=3),
       strategy=st.sampled_from(GUARDED), buffer_size=st.sampled_from([1, 4, 16, 64]), shuffle=st.booleans())
def test_loader_epochs_end_across_rescales(env, sizes, ks, strategy, buffer_size, shuffle):
    led = run_chain(env, sizes, ks, strategy, buffer_size, shuffle)
    assert all(led.whole(e, a) for a in env['lens'] for e in (1, 2)), "a document of epoch 1 or 2 was never whole"


@pytest.mark.parametrize('strategy,size', [('bestfit-pad', 64), ('bestfit-split', 100)])   # sizes where documents are held
def test_resume_is_exact_across_epochs_twice(env, strategy, size):
    "A loader resumed from a batch's state (twice, across epoch boundaries, documents held aside) gives the same batches and states."
    kw = dict(files=env['files'], **KW, pack=strategy, pack_buffer=size, copy=True)   # batches kept: tensors of their own
    with PackedLoader(env['tok'], **kw) as ld: full = [next(ld) for _ in range(80)]
    held = [i for i, b in enumerate(full) if min(b.state['stages']['pack']['buffer']['offset'], default=0) < 0]
    assert held, "no state held a document aside: the test would not cover it"
    ep = lambda i: full[i - 1].state['stages']['source']['cursor']['epoch']   # where a resume after `i` batches starts
    cuts = [held[0] + 1, next(i for i in range(held[0] + 2, 80) if ep(i) > ep(held[0] + 1))]   # from a state that holds some; then a later epoch
    got, sd, at = [], None, 0
    for c in cuts + [80]:
        with PackedLoader(env['tok'], **kw, resume_state_dict=sd) as ld:
            assert ld.resumed == (None if sd is None else 'exact')
            got += [next(ld) for _ in range(c - at)]
        sd, at = json.loads(json.dumps(got[-1].state)), c
    for a, b in zip(full, got):
        assert a.inputs.equal(b.inputs) and a.targets.equal(b.targets) and a.state == b.state and a.packed.metrics == b.packed.metrics


def test_a_state_from_before_loads(env):
    "A state saved before entry rows were kept (no `entered`) still resumes: its entries enter at the load, and epochs still end."
    from nanochat_dl.text.state import state_checksum as _checksum
    kw = dict(files=env['files'], **KW, pack='bestfit-split', pack_buffer=16)
    with PackedLoader(env['tok'], **kw) as ld:
        for _ in range(7): sd = next(ld).state
    sd = json.loads(json.dumps(sd))
    assert min(sd['stages']['pack']['buffer']['offset']) >= 0   # nothing held: a state an older version could have written
    del sd['stages']['pack']['entered']
    sd['checksum'] = _checksum(sd)
    led = Ledger(env['lens']); s = led.stream()
    with PackedLoader(env['tok'], **kw, resume_state_dict=sd) as ld:
        assert ld.resumed == 'exact' and set(ld.packer.entered_rows()) == {ld.packer.metrics_state()['rows']}
        for i in range(60): led.add(s, next(ld).packed, True, f"batch {i}")


def test_bestfit_crop_has_no_age_limit():
    "nanochat's rule stays nanochat's: no age limit can be set, and `epoch_of` changes nothing."
    with pytest.raises(ValueError, match="only the strategies"): Packer(8, strategy='bestfit-crop', max_wait=5)
    p = Packer(8, 4, 'bestfit-crop', bos_id=0, epoch_of=lambda k: k[0])
    assert p.max_wait is None and p.epoch_of is None
    assert Packer(8, 4, 'bestfit-pad').max_wait == 256 and Packer(8, 4, 'bestfit-pad', max_wait=None).max_wait is None


def test_entered_huge_run_refused_without_expanding():
    "A hand-edited `entered` with a huge count is refused by its total before the runs are expanded (no memory blow-up)."
    import resource
    from nanochat_dl.pipe.bestfit import Packer
    from nanochat_dl.pipe.packing import entered_rows
    docs = [np.array([1] + [5] * (n - 1)) for n in (3, 40, 7, 20)]
    p = Packer(16, 4, 'bestfit-pad', bos_id=1, epoch_of=lambda k: k[0])
    cnt = iter(range(10 ** 6))
    def pull():
        e, d = divmod(next(cnt), len(docs))
        return [docs[d]], [(e, d)]
    p.next_batch(2, pull)
    sd = json.loads(json.dumps(p.state_dict()))
    sd['entered'] = [[10 ** 12, 0]]
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, hard))
    try:
        with pytest.raises(ValueError, match='entered'):
            Packer(16, 4, 'bestfit-pad', bos_id=1, epoch_of=lambda k: k[0]).load_state_dict(
                sd, lambda keys: [docs[k[1]] for k in keys])
        with pytest.raises(ValueError, match='entered'): entered_rows([[10 ** 12, 0]], 3)
    finally: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize('bad', ['x', None, 1.0, -1.5, [0]])
def test_packer_state_with_a_bad_offset_names_the_offset(bad):
    "A hand-edited offset in `Packer.load_state_dict`'s buffer is refused as an offset (not as a miscount of `entered`, nor a TypeError)."
    from nanochat_dl.pipe.bestfit import Packer
    docs = [np.array([1] + [5] * (n - 1)) for n in (3, 40, 7, 20)]
    cnt = iter(range(10 ** 6))
    def pull():
        e, d = divmod(next(cnt), len(docs))
        return [docs[d]], [(e, d)]
    p = Packer(16, 4, 'bestfit-pad', bos_id=1, epoch_of=lambda k: k[0])
    p.next_batch(2, pull)
    sd = json.loads(json.dumps(p.state_dict()))
    sd['buffer'][0][1] = bad
    with pytest.raises(ValueError, match='offset'):
        Packer(16, 4, 'bestfit-pad', bos_id=1, epoch_of=lambda k: k[0]).load_state_dict(sd, lambda ks: [docs[k[1]] for k in ks])


def test_a_held_entry_at_a_wrong_offset_is_named_as_saved(env):
    "A hand-edited offset of an entry held aside (-2 - o, o where no piece starts) is refused quoting the offset as the state has it."
    from nanochat_dl.text.state import state_checksum as _checksum
    kw = dict(files=env['files'], **KW, pack='bestfit-pad', pack_buffer=64)
    with PackedLoader(env['tok'], **kw) as ld:
        for _ in range(80):
            sd = next(ld).state
            if min(sd['stages']['pack']['buffer']['offset'], default=0) < 0: break
    sd = json.loads(json.dumps(sd))
    offs = sd['stages']['pack']['buffer']['offset']
    i = offs.index(-1)
    offs[i] = -7   # a piece held aside at offset 5: bestfit-pad starts none there
    sd['checksum'] = _checksum(sd)
    with pytest.raises(ValueError, match=rf"entry {i} .*offset=-7"):
        PackedLoader(env['tok'], **kw, resume_state_dict=sd)


def test_max_wait_is_a_loader_setting(env):
    "`PackedLoader(max_wait=...)` reaches the packer and its config; a resume needs the same (an older state, without it, has its strategy's default)."
    from nanochat_dl.text.state import state_checksum as _checksum
    from nanochat_dl.pipe.bestfit import MAX_WAIT
    kw = dict(files=env['files'], **KW, pack_buffer=16)
    for strategy, mw, want in [('bestfit-pad', 'auto', MAX_WAIT), ('bestfit-split', None, None), ('bestfit-pad', 3, 3), ('bestfit-crop', 'auto', None)]:
        with PackedLoader(env['tok'], **kw, pack=strategy, max_wait=mw) as ld:
            assert ld.packer.max_wait == want and ld.config['max_wait'] == want
    with pytest.raises(ValueError, match="only the strategies"): PackedLoader(env['tok'], **kw, pack='bestfit-crop', max_wait=5)
    with PackedLoader(env['tok'], **kw, pack='bestfit-pad', max_wait=3) as ld: full = [json.loads(json.dumps(next(ld).state)) for _ in range(9)]
    with pytest.raises(ValueError, match=r"saved by a loader with max_wait=3, but this loader has max_wait=256: exact resume needs the same max_wait"):
        PackedLoader(env['tok'], **kw, pack='bestfit-pad', resume_state_dict=full[4])
    with PackedLoader(env['tok'], **kw, pack='bestfit-pad', max_wait=3, resume_state_dict=full[4]) as ld:
        assert [next(ld).state for _ in range(4)] == full[5:]
    with PackedLoader(env['tok'], **kw, pack='bestfit-pad') as ld: sd = json.loads(json.dumps([next(ld) for _ in range(5)][-1].state))
    del sd['config']['max_wait']; sd['checksum'] = _checksum(sd)     # a state from before the setting
    with PackedLoader(env['tok'], **kw, pack='bestfit-pad', resume_state_dict=sd) as ld: assert ld.resumed == 'exact'
    with pytest.raises(ValueError, match="max_wait"): PackedLoader(env['tok'], **kw, pack='bestfit-pad', max_wait=None, resume_state_dict=sd)
