"""Adversarial review of the pre-tokenized loader's bestfit state by number (format /5, nbs/tokens/12da_inputs): exact
resume at every step of long runs (rows and states), chains of resumes, DataLoader workers, reweighting at load,
hostile `inputs`/`replay` fields (resealed, so the checksum does not catch them first), size and the replay's bound."""
import itertools, json

import numpy as np
import pytest
import torch

from nanochat_dl.pipe.state import seal
from nanochat_dl.tokens import StreamingDataset, StreamingLoader
from nanochat_dl.tokens.inputs import pack_ints, unpack_ints
from test_streaming import toy_root

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
SPEC = {'web': {'a.arrow': 60}, 'code': {'x.arrow': 30}, 'books': {'y.arrow': 8}}   # books wraps many epochs
SCHED = [[0, [1, 1, 3]], [3000, [3, 1, 0]], [6000, [1, 2, 1]]]                    # issue 22's weight points
CASES = dict(
    sched_pb1=dict(weights=SCHED, bos_token=1, pack='bestfit', pack_buffer=1, shuffle_window=7, n_logical_shards=4),
    chunked_pb2=dict(weights=[1, 1, 1], bos_token=1, pack='bestfit', pack_buffer=2, shuffle_window=3, n_logical_shards=2,
                     max_chunk=50),
    sched_pb9=dict(weights=SCHED, bos_token=1, eos_token=2, pack='bestfit', pack_buffer=9, shuffle_window=60,
                   n_logical_shards=8))
T, B = 16, 2


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return toy_root(tmp_path_factory.mktemp('bfreview')/'root', SPEC, mean=40, T=32)


def run(root, kw, n, state=None):
    "`n` batches' rows and JSON states, from the start or from `state`."
    with StreamingLoader(root, T, B, prefetch=0, **kw) as ld:
        if state is not None: ld.load_state_dict(json.loads(json.dumps(state)))
        return [(b.rows.copy(), json.loads(json.dumps(b.state))) for b in itertools.islice(ld, n)]


@pytest.fixture(scope='module')
def fulls(root):
    return {k: run(root, kw, 205) for k, kw in CASES.items()}


def by_number(st): return 'inputs' in st['packer']


@pytest.mark.parametrize('case', list(CASES))
def test_every_step_resumes_rows_and_states(root, fulls, case):
    # resumed at every one of 200 steps (epochs of `books` wrap): the next rows are the run's; from a state by number the
    # next states are too; from one that names its entries (the documented fallback) they are again within 100 batches
    full, kw, later = fulls[case], CASES[case], []
    assert all(by_number(s) for _, s in full)           # (late pieces too, since /6: sched_pb9 97 states name some)
    for at in range(200):
        got = run(root, kw, 3, full[at][1])
        assert all(np.array_equal(g[0], f[0]) for g, f in zip(got, full[at + 1:])), at
        if by_number(full[at][1]): assert [g[1] for g in got] == [f[1] for f in full[at + 1:at + 4]], at
        elif at < 100: later.append(at)
    for at in later[:3]:
        got = run(root, kw, 104 - at, full[at][1])
        assert got[-1][1] == full[104][1] and all(np.array_equal(g[0], f[0]) for g, f in zip(got, full[at + 1:]))


def test_chains_of_resumes_and_reweighting_at_load(root, fulls):
    # a state saved right after a resume, resumed again, five times; then a loader reweighted at its load, chained
    full, kw = fulls['chunked_pb2'], CASES['chunked_pb2']
    st, at = full[40][1], 40
    for k in range(5):
        got = run(root, kw, 1 + k, st)
        assert all(np.array_equal(g[0], f[0]) and g[1] == f[1] for g, f in zip(got, full[at + 1:]))
        st, at = got[-1][1], at + 1 + k
    kw2 = dict(kw, weights=SCHED)
    run2 = run(root, kw2, 60, full[100][1])
    for k in (0, 1, 5, 30):
        got = run(root, kw2, 6, run2[k][1])
        assert all(np.array_equal(g[0], f[0]) and g[1] == f[1] for g, f in zip(got, run2[k + 1:])), k


def test_dataloader_workers_resume_and_chain(root):
    from torchdata.stateful_dataloader import StatefulDataLoader
    kw = dict(bos_token=1, pack='bestfit', pack_buffer=2, shuffle_window=5, n_logical_shards=4, weights=SCHED)
    mk = lambda: StatefulDataLoader(StreamingDataset(root, 16, **kw), batch_size=2, num_workers=2)
    dl, out = mk(), []
    it = iter(dl)
    for _ in range(70): out.append((next(it)[0].clone(), json.loads(json.dumps(dl.state_dict()))))
    del it, dl
    for at in (0, 33, 55):
        d2 = mk(); d2.load_state_dict(out[at][1]); it2 = iter(d2)
        for j in range(at + 1, at + 6): assert torch.equal(next(it2)[0], out[j][0]), (at, j)
        s = json.loads(json.dumps(d2.state_dict())); del it2, d2
        d3 = mk(); d3.load_state_dict(s); it3 = iter(d3)
        for j in range(at + 6, at + 12): assert torch.equal(next(it3)[0], out[j][0]), (at, j)
        del it3, d3


def hostile(st):
    "Edits of a by-number state's `inputs` and `replay` (name, edit, the field its refusal names)."
    pk = st['packer']
    v, bits = unpack_ints(pk['inputs'], 10**6, 'x')
    on = np.flatnonzero(np.unpackbits(np.frombuffer(bits, np.uint8))[:v[0]])
    off = np.setdiff1d(np.arange(v[0]), on)
    def flip(i): b = bytearray(bits); b[i // 8] ^= 0x80 >> (i % 8); return bytes(b)
    def inputs(vv, bb): return lambda s: s['packer'].__setitem__('inputs', pack_ints(vv, bb))
    def rp(f): return lambda s: f(s['packer']['replay'])
    return [('a bit set', inputs(v, flip(int(off[len(off) // 2]))), 'metrics'),
            ('a bit cleared', inputs(v, flip(int(on[0]))), 'metrics'),
            ('the last bit cleared', inputs(v, flip(int(on[-1]))), 'metrics'),
            ('span - 1', inputs([v[0] - 1] + v[1:], bits), 'inputs|replay'),
            ('span + 8', inputs([v[0] + 8] + v[1:], bits + b'\0'), 'inputs|replay'),
            ('span far beyond', inputs([10**7] + v[1:], bits), 'inputs'),
            ('truncated base85', lambda s: s['packer'].__setitem__('inputs', pk['inputs'][:-3]), 'inputs'),
            ('a mark moved (offset)', rp(lambda r: r['windows'][0].__setitem__(1, r['windows'][0][1] + 1)), 'windows'),
            ('a mark moved (block)', rp(lambda r: r['windows'][1].__setitem__(0, r['windows'][1][0] + 1)), 'windows'),
            ('a mixer counter + 1', rp(lambda r: r['tokens'].__setitem__(0, r['tokens'][0] + 1)), 'tokens'),
            ('docs_in + 1', lambda s: s['packer']['metrics'].__setitem__('docs_in', s['packer']['metrics']['docs_in'] + 1),
             'metrics')]


@pytest.mark.parametrize('case', ['chunked_pb2', 'sched_pb1'])
def test_hostile_inputs_are_refused_naming_the_field(root, fulls, case):
    # each edit resealed (a checksum anyone can compute), so the field checks, not the checksum, must refuse it
    full, kw = fulls[case], CASES[case]
    at = next(i for i in range(100, 200) if by_number(full[i][1]))
    for name, edit, field in hostile(full[at][1]):
        s = json.loads(json.dumps(full[at][1])); edit(s)
        s = seal({k: x for k, x in s.items() if k != 'checksum'})
        with pytest.raises(ValueError, match=field), StreamingLoader(root, T, B, prefetch=0, **kw) as ld:
            ld.load_state_dict(s); next(ld)
        # unsealed: refused too (by a field check or the checksum)
        s['checksum'] = full[at][1]['checksum']
        with pytest.raises(ValueError), StreamingLoader(root, T, B, prefetch=0, **kw) as ld: ld.load_state_dict(s)


def test_states_stay_small_and_the_replay_bounded(tmp_path):
    # pack_buffer 10,000 over 4,500 documents: states ~1.6 KB, none grows with the steps, the replay reads at most
    # 4 * pack_buffer + 1024 inputs
    r2 = toy_root(tmp_path/'r', {'web': {'a.arrow': 3000}, 'code': {'x.arrow': 1500}}, mean=30, T=32)
    for pb, n in ((10_000, 40), (2, 300)):
        kw = dict(weights=[2, 1], bos_token=1, pack='bestfit', pack_buffer=pb, shuffle_window=50, n_logical_shards=4)
        with StreamingLoader(r2, 16, 8, prefetch=0, **kw) as ld:
            sts = [json.loads(json.dumps(b.state)) for b in itertools.islice(ld, n)]
        sizes = [len(json.dumps(s)) for s in sts]
        assert max(sizes) < 2600 and max(sizes[n // 2:]) < min(sizes) + 400, (pb, sizes[::50])
        spans = [unpack_ints(s['packer']['inputs'], 10**7, 'x')[0][0] for s in sts if by_number(s)]
        assert spans and max(spans) <= 4 * pb + 1024
        with StreamingLoader(r2, 16, 8, prefetch=0, **kw) as ld:
            ld.load_state_dict(sts[n // 2])
            assert json.loads(json.dumps(next(ld).state)) == sts[n // 2 + 1]


def test_a_piece_let_in_late_that_left_the_buffer_does_not_make_the_state_name_entries(fulls):
    # the fallback was `oldest pending input <= the greatest number ever let in late` (never lowered): a state named its
    # entries while no late piece was buffered any more; then only while one was buffered (sched_pb9 108 of 205 states
    # by number, 100 before); since /6 never (late pieces named by number: 205 of 205 in each case); every resume from
    # them exact (test_every_step_resumes_rows_and_states)
    assert all(by_number(s) for k in ('sched_pb9', 'sched_pb1', 'chunked_pb2') for _, s in fulls[k])
    assert sum('late' in s['packer'] for _, s in fulls['sched_pb9']) >= 90


def test_a_small_dataset_wrapping_keeps_the_state_by_number(tmp_path):
    # web 4,000 documents mixed 3:1 with books of 20 (books wraps every few batches), pack_buffer 2,000: pieces the epoch
    # guard held and let in after a later pull ('late') are buffered in most states. They named their entries (18 of 150
    # by number, up to 684 entries, 15 KB); now each late piece is named by number, row entered and place in the order
    # (format /6, 'late'): 150 of 150 by number, at most 1,669 bytes, and a resume from each is exact
    r = toy_root(tmp_path/'r', {'web': {'a.arrow': 4000}, 'books': {'y.arrow': 20}}, mean=100, T=512)
    kw = dict(weights=[3, 1], bos_token=1, pack='bestfit', pack_buffer=2000, shuffle_window=200, n_logical_shards=4,
              max_chunk=64)
    with StreamingLoader(r, 128, 8, prefetch=0, **kw) as ld:
        full = [(b.rows.copy(), json.loads(json.dumps(b.state))) for b in itertools.islice(ld, 150)]
    sts = [s for _, s in full]
    assert sum(by_number(s) for s in sts) >= 0.9 * len(sts) and max(len(json.dumps(s)) for s in sts) < 4000
    assert sum('late' in s['packer'] for s in sts) >= 100          # (the case the fix is for: late pieces buffered)
    for at in range(0, 148, 9):
        with StreamingLoader(r, 128, 8, prefetch=0, **kw) as ld:
            ld.load_state_dict(sts[at])
            got = [(b.rows.copy(), json.loads(json.dumps(b.state))) for b in itertools.islice(ld, 2)]
        assert all(np.array_equal(g[0], f[0]) and g[1] == f[1] for g, f in zip(got, full[at + 1:])), at


def test_hostile_late_fields_are_refused(root, fulls):
    # a state naming late pieces ('late': per piece its number, rows since it entered, inputs numbered then), edited
    # and resealed: refused naming the field
    full, kw = fulls['sched_pb9'], CASES['sched_pb9']
    at = next(i for i in range(60, 200) if 'late' in full[i][1]['packer'])
    lv = unpack_ints(full[at][1]['packer']['late'], 10**6, 'x')[0]
    span = unpack_ints(full[at][1]['packer']['inputs'], 10**6, 'x')[0][0]
    made = full[at][1]['packer']['metrics']['rows']
    edits = [lv[:-1], lv[:2] + [made + 1] + lv[3:], lv[:2] + [span + 1] + lv[3:], lv[:2] + [lv[0]] + lv[3:],
             lv + lv[:3], [span - 1 if lv[0] != span - 1 else span - 2] + lv[1:]]
    for e in edits:
        s = json.loads(json.dumps(full[at][1])); s['packer']['late'] = pack_ints(e)
        s = seal({k: x for k, x in s.items() if k != 'checksum'})
        with pytest.raises(ValueError, match=r"\['late'\]|metrics|inputs"), \
                StreamingLoader(root, T, B, prefetch=0, **kw) as ld:
            ld.load_state_dict(s); next(ld)


def test_a_state_of_format_5_still_loads(root, fulls):
    # /5 named late pieces' entries, so a /5 state by number has no 'late': today's states without one, as /5, resume
    full, kw = fulls['sched_pb9'], CASES['sched_pb9']
    ats = [i for i in range(20, 200) if by_number(full[i][1]) and 'late' not in full[i][1]['packer']][:5]
    assert ats
    for at in ats:
        s = dict(json.loads(json.dumps(full[at][1])), format='nanochat_dl.streaming/5')
        got = run(root, kw, 3, seal({k: x for k, x in s.items() if k != 'checksum'}))
        assert all(np.array_equal(g[0], f[0]) for g, f in zip(got, full[at + 1:])), at
        assert [g[1] for g in got] == [f[1] for f in full[at + 1:at + 4]], at
