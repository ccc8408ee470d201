"""Issue 21 section 2: the streaming state format /4 (block windows named by a cursor, packed positions). States of
format /3, written by the code before it (tests/fixtures/streaming3_states.json, made with that commit's loader over
`toy_root(SPEC)`), still load and resume exactly; a new state's size does not grow with its window."""
import hashlib, json
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.tokens import StreamingLoader
from test_streaming import toy_root, SPEC

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
FIXTURE = json.loads((Path(__file__).parent/'fixtures'/'streaming3_states.json').read_text())


@pytest.fixture(scope='module')
def root(tmp_path_factory): return toy_root(tmp_path_factory.mktemp('fmt')/'root', SPEC)


def digest(rows): return hashlib.sha256(np.ascontiguousarray(rows, dtype=np.int64).tobytes()).hexdigest()[:16]


@pytest.mark.parametrize('case', FIXTURE['cases'], ids=lambda c: c['kwargs']['pack'])
def test_a_state_of_format_3_resumes_exactly(root, case):
    "A /3 state (reservoir windows named piece by piece) loads into today's loader (block by default) and resumes exactly."
    st = case['state']
    assert st['format'] == 'nanochat_dl.streaming/3' and 'shuffle' in st['datasets']['web']
    ld = StreamingLoader(root, case['seq_len'], case['batch_size'], **case['kwargs']).load_state_dict(st)
    assert [digest(next(ld).rows) for _ in range(len(case['next_rows_sha256']))] == case['next_rows_sha256']
    again = ld.state_dict()                          # it goes on with the window it was saved with, in format /6
    assert again['format'] == 'nanochat_dl.streaming/6' and again['config']['shuffle'] == 'reservoir'
    ld.close()


@pytest.mark.parametrize('pack', ['concat', 'pad', 'bestfit'])
def test_block_state_does_not_grow_with_the_window(root, pack):
    "With block windows the datasets' part of a state is some hundred bytes for a window of 7 or of 400 pieces."
    def parts(win, shuffle):
        with StreamingLoader(root, 16, 4, rank=0, world_size=1, n_logical_shards=16, shuffle_window=win, pack=pack,
                             pack_buffer=16, prefetch=0, shuffle=shuffle) as ld:
            for _ in range(30): next(ld)
            return len(json.dumps(ld.state_dict()['datasets']))
    small, big = parts(7, 'block'), parts(400, 'block')
    # (the packed cursors differ by some bytes: where a block began)
    assert max(small, big) < 600 and abs(small - big) < 64 and parts(400, 'reservoir') > 5 * big


@pytest.mark.parametrize('pack', ['concat', 'pad', 'bestfit'])
def test_block_states_resume_exactly_after_every_batch(root, pack):
    "A /4 state saved after any of 40 batches (mid block, mid cut document, a new epoch of books) resumes exactly."
    kw = dict(rank=0, world_size=1, n_logical_shards=16, shuffle_window=9, pack=pack, pack_buffer=16, max_chunk=24,
              bos_token=1, eos_token=2, prefetch=0, weights=[6, 1, 1])
    ld = StreamingLoader(root, 16, 4, **kw)
    states, rows = [], []
    for _ in range(44): b = next(ld); rows.append(b.rows); states.append(b.state)
    assert max(e for e, _ in ld.stream.explicit_state()['datasets']['books']['epoch']) >= 2   # books went on to epoch 2
    ld.close()
    for k in range(40):
        st = json.loads(json.dumps(states[k]))
        assert st['format'] == 'nanochat_dl.streaming/6' and 'window' in st['datasets']['web']
        again = StreamingLoader(root, 16, 4, **kw).load_state_dict(st)
        for j in range(k + 1, k + 4): assert np.array_equal(next(again).rows, rows[j])
        again.close()


def test_impossible_block_states_are_refused_naming_the_field(root):
    "A /4 state's own fields are checked: the packed positions, the window's cursor, and entries against the cursors now."
    from test_streaming import undrawn, geometry
    kw = dict(bos_token=1, eos_token=2, max_chunk=30, n_logical_shards=6, shuffle_window=9, prefetch=0, pack='concat',
              weights=[1, 1, 1], world_size=2, rank=0)
    with StreamingLoader(root, 12, 2, **kw) as ld:
        for _ in range(9): next(ld)
        sd = json.loads(json.dumps(ld.state_dict()))
    ts = geometry(root, kw)
    now = ts.load_state(json.loads(json.dumps(sd))).explicit_state()['datasets']['web']   # the cursors after the replay
    web = ts.names.index('web')
    cases = [(lambda st: st['datasets']['web'].__setitem__('pos', 'z0'), "['web']['pos']='z0': expected the packed"),
             (lambda st: st['datasets']['web'].__setitem__('window', [1]), "['web']['window']=[1]: expected [block, offset]"),
             (lambda st: st['datasets']['web']['window'].__setitem__(1, 10), "['web']['window']: window state has offset 10"),
             (lambda st: st['packer']['entries'].__setitem__(0, [web, *undrawn(ts, web, now), 0, 0]),
              'cannot have been delivered yet')]
    for change, msg in cases:
        st = json.loads(json.dumps(sd)); change(st)
        with StreamingLoader(root, 12, 2, **kw) as fresh, StreamingLoader(root, 12, 2, **kw) as plain:
            with pytest.raises(ValueError) as e: fresh.load_state_dict(st)
            assert msg in str(e.value), str(e.value)
            assert np.array_equal(next(fresh).rows, next(plain).rows)          # nothing of the refused state stayed


def test_a_block_begun_in_the_last_epoch_of_a_cut_document_resumes(root):
    "Found by the rescale property test: the cut document's epoch-2 order must not be used to check its epoch-3 draws."
    kw = dict(weights=[1, 2, 3], bos_token=1, eos_token=2, n_logical_shards=11, shuffle_window=3, max_chunk=50,
              pack='concat', pack_buffer=6, seed=3, rank=5, world_size=6, prefetch=0)
    ld = StreamingLoader(root, 24, 3, **kw)
    states, rows = [], []
    for _ in range(30): b = next(ld); states.append(json.loads(json.dumps(b.state))); rows.append(b.rows)
    ld.close()
    for k in range(28):
        with StreamingLoader(root, 24, 3, **kw) as again:
            again.load_state_dict(states[k])
            assert np.array_equal(next(again).rows, rows[k + 1]), k
