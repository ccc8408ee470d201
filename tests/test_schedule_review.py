"""Review of the mixture schedules (issue 22, section 1): hostile inputs, each test failing before its fix."""
import json, math, shutil, subprocess, sys
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.tokens.files import write_token_file
from nanochat_dl.tokens.meta import write_counts
from nanochat_dl.tokens.pieces import MixSchedule
from nanochat_dl.tokens.state import stream_config
from nanochat_dl.tokens.fast import FastTokenStream
from nanochat_dl.tokens.stream import TokenStream
from nanochat_dl.tokens.loader import StreamingLoader, open_epochs

CLI = shutil.which('nanochat-dl') or str(Path(sys.executable).parent / 'nanochat-dl')


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    "A token root of two datasets, code and web, each document's ids saying which it is."
    path, rng, uid, c = tmp_path_factory.mktemp('sched_review')/'root', np.random.default_rng(0), 1, {}
    for ds, n, mean in [('web', 600, 40), ('code', 300, 50)]:
        docs = [(np.int64(uid + i) << 12) | (np.arange(l) & 0xFFF) for i, l in enumerate(rng.integers(1, 2 * mean, n))]
        uid += n
        c[(ds, 'a.arrow')] = write_token_file(path/ds/'a.arrow', docs)
    write_counts(path, c)
    return path


@pytest.mark.parametrize('t', [10**400, 2**1024, 10**5000], ids=['1e400', '2^1024', '1e5000'])
def test_a_point_beyond_a_float_is_refused_naming_it(t):
    """A whole number of tokens_seen that no float holds: refused naming the point (was: OverflowError, no point;
    an int too long for `str`: a ValueError about digits)."""
    with pytest.raises(ValueError, match=r"weights point 1 .*: tokens_seen '2\*\*\d+ or more' is invalid"):
        MixSchedule([(0, {'a': 1}), (t, {'b': 1})], ['a', 'b'])


@pytest.mark.parametrize('cls', [FastTokenStream, TokenStream])
@pytest.mark.parametrize('nw', [1, 2, 3])
def test_workers_follow_the_schedule_in_their_ranks_tokens(root, cls, nw):
    """`tokens_seen` is the rank's count: with n DataLoader workers (each a stream of 1/n of the rank's shards) the
    mix changes at the rank's tokens_seen, not at n times it (was: each worker's own count, the schedule n times
    slower)."""
    sched = [(0, {'web': 1}), (5000, {'web': 1}), (5001, {'code': 1})]
    r, cfg, _ = stream_config(root, 32, weights=sched, bos_token=1, eos_token=2, n_logical_shards=12, max_chunk=30)
    ss, first = [cls(r, cfg, w, nw) for w in range(nw)], None
    while first is None:
        for s in ss: s.next_rows(1)
        T = sum(sum(s.mixer.tokens) for s in ss)
        if any(s.mixer.tokens[0] for s in ss): first = T      # (datasets in order: code, web)
        assert T < 20_000
    assert 4000 < first < 6000, first             # (the workers' counts differ a little: each its own x n)



def three(tmp_path):
    "A token root of three datasets (books, code, web), small enough to read epoch 1 of each in seconds."
    path, rng, uid, c = tmp_path/'root3', np.random.default_rng(1), 1, {}
    for ds, n, mean in [('web', 60, 40), ('code', 30, 50), ('books', 10, 80)]:
        docs = [(np.int64(uid + i) << 12) | (np.arange(l) & 0xFFF) for i, l in enumerate(rng.integers(1, 2 * mean, n))]
        uid += n
        c[(ds, 'a.arrow')] = write_token_file(path/ds/'a.arrow', docs)
    write_counts(path, c)
    return path


@pytest.mark.parametrize('sched, books', [([(0, {'web': 1})], math.inf),
                                          ([(0, {'web': 1}), (500, {'code': 1, 'web': 1})], math.inf),
                                          ([(0, {'web': 1}), (500, {'code': 1}), (900, {'web': 1, 'code': 2})],
                                           math.inf),
                                          ([(0, {'web': 1}), (500, {'books': 1})], 1)])
def test_open_epochs_reads_a_schedule_per_dataset(tmp_path, sched, books):
    """`open_epochs` of a state saved with a schedule: a dataset of weight 0 at every point is never read (inf), one
    of a positive weight at some point holds its epoch open (was: the schedule's points indexed by the dataset's
    number, an IndexError for fewer points than datasets, a dataset never read held open for as many)."""
    with StreamingLoader(three(tmp_path), 32, 4, weights=sched, bos_token=1, prefetch=0) as ld:
        st = next(ld).state
    got = open_epochs(st)
    assert got['books'] == books and got['web'] == 1, got


def test_the_rescale_check_refuses_a_schedule_that_ends_a_dataset_at_weight_0(tmp_path):
    """check-resume's rescale reads epoch 1 of every dataset to its end: a schedule whose last point gives a dataset
    read before weight 0 is refused at once, naming it (was: 100,000 batches per rank, then 'did not read epoch 1')."""
    cfg = tmp_path/'s.json'
    cfg.write_text(json.dumps({'weights': [[0, {'web': 1, 'books': 1}], [2000, {'web': 1}]]}))
    r = subprocess.run([CLI, 'check-resume', '--loader', 'tokens', '--data', three(tmp_path), '--config', cfg, '-b', '4',
                        '-t', '32', '--batches', '6', '--world-size-from', '2', '--world-size-to', '3'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "dataset 'books' has weight 0 at the schedule's last point (tokens_seen 2000)" in r.stderr, r.stderr


def test_a_rescale_2_3_2_with_a_schedule_delivers_epoch_1_once_and_resumes_exactly(tmp_path):
    "Save on 2 ranks mid-ramp, rescale to 3, save, back to 2: each document of epoch 1 tiled once; the last resumes."
    from nanochat_dl.bench.check import loader_maker, run_ranks, _tiling
    import hashlib
    sched = [[0, {'web': 3, 'code': 1}], [1500, {'web': 3, 'code': 1}], [3000, {'web': 1, 'code': 0, 'books': 2}],
             [4500, {'code': 1, 'web': 0.5, 'books': 0.1}]]
    make = loader_maker('tokens', three(tmp_path), 4, 32, weights=sched, shuffle_window=10, pack='bestfit', max_chunk=40,
                        bos_token=1, n_logical_shards=12)
    s0, _, _ = run_ranks(make, 2, None)
    want, ends = {d for d, *_ in s0}, {}
    for d, a, b in s0: ends[d] = max(ends.get(d, 0), b)
    p1, _, st = run_ranks(make, 2, 9)
    p2, _, st = run_ranks(make, 3, 5, st)
    assert all(sum(s['mix']['base']) < sum(d['tokens'] for d in s['datasets'].values()) for s in st)   # (anchored)
    p3, _, st = run_ranks(make, 2, 4, st)
    digest = lambda ld, n: [hashlib.sha1(next(ld).inputs.numpy().tobytes()).hexdigest() for _ in range(n)]
    for r in range(2):
        with make(r, 2, st) as a: run = digest(a, 8)
        with make(r, 2, st) as a: digest(a, 3); mid = json.loads(json.dumps(a.state_dict()))
        with make(r, 2) as a: a.load_state_dict(mid); assert digest(a, 5) == run[3:]
    p4, kept, _ = run_ranks(make, 2, None, st)
    assert _tiling(p1 + p2 + p3 + p4, kept, ends) == ([], [])
    assert {d for d, *_ in p1 + p2 + p3 + p4} == want


@pytest.mark.parametrize('pack', ['concat', 'pad', 'bestfit'])
def test_workers_fast_and_reference_streams_agree_on_a_schedule(root, pack):
    "With 2 workers (scale 2), the fast stream gives the reference's rows and counters, with max_chunk and a trim."
    sched = [(0, {'web': 3, 'code': 1}), (1500, {'web': 3, 'code': 1}), (3000, {'code': 1}), (4500, {'web': 1})]
    for extra in [dict(max_chunk=30), dict(max_chunk=None, strip_tokens=[1], min_length=4)]:
        r, cfg, _ = stream_config(root, 32, weights=sched, bos_token=1, eos_token=2, n_logical_shards=12,
                                  shuffle_window=8, pack=pack, **extra)
        for w in range(2):
            a, b = FastTokenStream(r, cfg, w, 2), TokenStream(r, cfg, w, 2)
            for _ in range(150): assert np.array_equal(a.next_rows(2).rows, b.next_rows(2).rows), (extra, w)
            assert a.mixer.tokens == b.mixer.tokens


def test_a_mixer_given_a_mixschedule_loads_a_state_with_weights():
    """`Mixer(ups, MixSchedule(...))` (as the chapter builds one) loads a state that names the weights it was saved
    with: the same schedule keeps the targets, another anchors them (was: TypeError, a MixSchedule is not iterable)."""
    from nanochat_dl.tokens.pieces import Mixer
    sc = MixSchedule([(0, [1, 0]), (100, [0, 1])], ['a', 'b'])
    m = Mixer([None, None], sc)
    assert m.load_state_dict({'tokens': [5, 5], 'weights': [[0, [1, 0]], [100, [0, 1]]]}).base is None
    assert m.load_state_dict({'tokens': [5, 5], 'weights': [[0, [1, 0]], [200, [0, 1]]]}).base == [5, 5]


@pytest.mark.parametrize('w', [[(0, {'a': 10**5000})], [10**5000, 1]], ids=['schedule', 'fixed'])
def test_a_weight_too_long_to_print_is_refused_naming_the_weight(w):
    "A weight of 5,001 digits: refused as a weight no float holds (was: Python's 'Exceeds the limit (4300 digits)')."
    from nanochat_dl.tokens.pieces import Mixer
    with pytest.raises(ValueError, match=r"weight \(a number too long to print\) of (dataset 'a'|stage 0) is invalid: "
                                         r"expected a finite number"):
        MixSchedule(w, ['a', 'b']) if isinstance(w[0], tuple) else Mixer([None, None], w)
