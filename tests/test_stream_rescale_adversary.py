"""Issue 18 item 1, attacked (nbs/tokens/12i_loader.ipynb): a rank whose logical shards are epochs apart after a rescale or a
hand-edited state. Each test failed before its fix."""
import copy
import json
import signal
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.tokens.meta import write_counts
from nanochat_dl.tokens.files import write_token_file
from nanochat_dl.tokens import StreamingLoader, open_epochs
from nanochat_dl.pipe import seal

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
    seal(st)                                                              # (as a loader would hand it out)
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
    seal(st)
    mk = lambda r, W: StreamingLoader(led.tr.root, 16, 2, rank=r, world_size=W, n_logical_shards=4, prefetch=0, **kw)
    with pytest.raises(ValueError, match=r"\['parked'\]\[1\]: .*twice|\['parked'\]\[1\]: .*also"):
        within(15, lambda: mk(0, 1).load_state_dict(st))
    with pytest.raises(ValueError, match=r"\['parked'\]\[1\]"):
        within(15, lambda: mk(1, 2).load_state_dict([st]))


from nanochat_dl.tokens.root import TokenRoot
from nanochat_dl.tokens import owned_shards, shard_starts
from test_stream_epochs_end import Ledger, assert_tiles_to


def drift_lengths(n, W, S, rng, long=30):
    "`n` document lengths over `S` logical shards: rank 0 of `W`'s long, the others' 0 to 2 tokens (ranks drift apart by tens of epochs)."
    b, own = shard_starts(n, S), owned_shards(S, 0, W)
    L = [int(rng.integers(long // 2, 2 * long)) if own.start <= s < own.stop else int(rng.integers(0, 3)) for s in range(S) for _ in range(b[s + 1] - b[s])]
    for s in range(S):
        if b[s + 1] > b[s]: L[b[s]] = max(L[b[s]], 1)
    return L


@pytest.mark.parametrize('chain', [(3, 5, 2), (1, 7, 3), (2, 9, 1), (4, 1)])
@pytest.mark.parametrize('kw', [dict(pack='concat', max_chunk=2, shuffle_window=5), dict(pack='bestfit', max_chunk=3, shuffle_window=50, pack_buffer=4)])
def test_drifted_chains_keep_the_contract_and_resume_exactly(tmp_path, chain, kw):
    """Ranks tens of epochs apart at each rescale of the chain (two datasets of different epoch lengths): on every rank the
    contract holds, a resume through JSON at odd batch counts continues bit for bit, and every document of epochs 1 to 3
    is delivered exactly once across the ranks."""
    S, rng = 12, np.random.default_rng(0)
    r = write(tmp_path/'root', {'web': drift_lengths(40, chain[0], S, rng), 'code': drift_lengths(17, chain[0], S, rng, long=10)})
    led, states = Ledger(TokenRoot(r), S), None
    mk = lambda rank, W: StreamingLoader(r, 8, 2, rank=rank, world_size=W, n_logical_shards=S, prefetch=0, weights=[1, 2], **kw)
    for j, (W, n) in enumerate(zip(chain, [41, 23, 9])):
        units = [mk(rank, W) for rank in range(W)]
        for rank, ld in enumerate(units):
            if states is not None: ld.load_state_dict(json.loads(json.dumps(states)))
            for k in range(1, 3000):
                if j == len(chain) - 1 and min(open_epochs(ld.state_dict()).values()) > 3: break
                if j < len(chain) - 1 and k > n: break
                assert led.run(ld, 1, rank, W) == set(), (j, rank, k)
                if k % 7 == 3:                                        # resumed here, the next batch is the same
                    again = mk(rank, W).load_state_dict(json.loads(json.dumps(ld.state_dict())))
                    b = next(again); again.close()
                    assert led.run(ld, 1, rank, W) == set() and np.array_equal(b.rows, led.last.rows), (j, rank, k)
            else: raise AssertionError('epoch 3 never closed')
        states = [ld.state_dict() for ld in units]
        for ld in units: ld.close()
    assert_tiles_to(led, 3)


@pytest.mark.parametrize('E', [10**18, 2**62 // 3])
def test_epochs_too_far_to_count_are_refused(tmp_path, E):
    """Token-less shards at epoch 1 beside shards with tokens at epoch `E`: the empty shards would start epoch `E` (their
    draws counted) past what a state holds. Refused by name on load. Before the fix: at 10**18 the loader ran and saved a
    state it then refused ('draws' too large); at 2**62 // 3 an OverflowError."""
    r = write(tmp_path/'root', {'web': [0, 0, 0, 5, 3, 4, 0, 0, 0, 2, 6, 1]})
    mk = lambda: StreamingLoader(r, 4, 2, rank=0, world_size=1, n_logical_shards=4, prefetch=0, pack='concat', shuffle_window=0)
    st = mk().state_dict()
    d = st['datasets']['web']
    d['epoch'], d['draws'] = [[1, 1], [E, 1], [1, 1], [E, 1]], 2 * 3 * (E - 1)
    seal(st)                                                              # (as a loader would hand it out)
    ld = mk()
    with pytest.raises(ValueError, match=r"\['web'\]\['epoch'\]: epoch \d+ over 12 documents"): ld.load_state_dict(st)
    assert np.array_equal(next(ld).rows, next(mk()).rows)                   # nothing half-loaded


def test_max_wait_takes_the_values_packed_loader_takes(tmp_path):
    "`StreamingLoader(max_wait=...)` takes what `PackedLoader` takes ('auto': the default; None; an int >= 0) and refuses the rest by name. Before: 'auto' was refused."
    from nanochat_dl.pipe.bestfit import MAX_WAIT
    r = write(tmp_path/'root', {'web': [5, 0, 7, 3, 9, 1, 0, 4] * 3})
    mk = lambda mw: StreamingLoader(r, 8, 2, rank=0, world_size=1, n_logical_shards=4, prefetch=0, pack='bestfit', max_wait=mw)
    for mw, want in (('auto', MAX_WAIT), (None, None), (0, 0), (np.int64(3), 3), (10**18, 10**18)):
        ld = mk(mw)
        assert ld.config['max_wait'] == want and type(ld.config['max_wait']) in (int, type(None))
        next(ld)
        assert json.loads(json.dumps(ld.state_dict()))['config']['max_wait'] == want
    for bad in (-1, True, 1.5, '3', 'Auto', [1], np.array([1, 2])):
        with pytest.raises(ValueError, match=r"max_wait=.* is invalid"): mk(bad)
