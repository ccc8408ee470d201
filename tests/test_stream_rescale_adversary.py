"""Issue 18 item 1, attacked (nbs/13_streaming.ipynb): a rank whose logical shards are epochs apart after a rescale or a
hand-edited state. Each test failed before its fix."""
import copy
import json
import signal
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.arrow import write_counts, write_token_file
from nanochat_dl.streaming import StreamingLoader, open_epochs

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def write(path, spec):
    "Datasets `{name: lengths}` as one token file each; token = uid << 12 | position."
    c, uid = {}, 1
    for ds, L in spec.items():
        c[(ds, 'a.arrow')] = write_token_file(Path(path)/ds/'a.arrow', [(np.int64(uid + i) << 12) | np.arange(l) for i, l in enumerate(L)])
        uid += len(L)
    write_counts(path, c)
    return Path(path)


class Hang(Exception): pass


def within(seconds, f):
    "`f()`, or `Hang` after `seconds`."
    def stop(*_): raise Hang(f'still running after {seconds} s')
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try: return f()
    finally: signal.alarm(0); signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize('pack,window', [('concat', 0), ('pad', 1), ('bestfit', 10)])
def test_empty_shards_far_behind_do_not_spin(tmp_path, pack, window):
    """Shards 0 and 2 hold only empty documents at epoch 1, shards 1 and 3 hold tokens at epoch 10**6 (a hand-edited state,
    or ranks far apart): the first batch comes at once, from epoch 10**6. Before: the rank walked the empty shards one epoch
    at a time (a million walks, no token) before drawing from the others: a hang."""
    r = write(tmp_path/'root', {'web': [0, 0, 0, 5, 3, 4, 0, 0, 0, 2, 6, 1]})
    mk = lambda: StreamingLoader(r, 4, 2, rank=0, world_size=1, n_logical_shards=4, prefetch=0, pack=pack, shuffle_window=window)
    st = mk().state_dict()
    d, E = st['datasets']['web'], 10**6
    d['epoch'], d['draws'] = [[1, 1], [E, 1], [1, 1], [E, 1]], 2 * 3 * (E - 1)
    ld = mk().load_state_dict(json.loads(json.dumps(st)))
    got = within(10, lambda: [s.key.epoch for _ in range(6) for row in next(ld).segments for s in row])
    assert got[0] == E and min(got) == E, got
    assert open_epochs(ld.state_dict())['web'] >= E
    # resumes exactly from there
    s = ld.state_dict(); want = [next(ld).rows.copy() for _ in range(3)]
    again = mk().load_state_dict(json.loads(json.dumps(s)))
    assert all(np.array_equal(next(again).rows, w) for w in want)


from test_stream_epochs_end import DRIFT, drifted


@pytest.mark.parametrize('kw', DRIFT[:2])
def test_a_huge_parked_list_is_refused_at_once(tmp_path, kw):
    """A state whose 'parked' repeats one piece a million times: refused at the first repeat, naming it, on one rank's resume
    and in a rescale's list of states. Before: every entry was checked first (its document read, its order's index found),
    a hang of minutes."""
    led, one, _ = drifted(tmp_path, kw)
    st = one.state_dict()
    p = st['datasets']['web']['parked'][0]
    st['datasets']['web']['parked'] = [list(p)] * 10**6
    mk = lambda r, W: StreamingLoader(led.tr.root, 16, 2, rank=r, world_size=W, n_logical_shards=4, prefetch=0, **kw)
    with pytest.raises(ValueError, match=r"\['parked'\]\[1\]: .*twice|\['parked'\]\[1\]: .*also"):
        within(10, lambda: mk(0, 1).load_state_dict(st))
    with pytest.raises(ValueError, match=r"\['parked'\]\[1\]"):
        within(10, lambda: mk(1, 2).load_state_dict([st]))
