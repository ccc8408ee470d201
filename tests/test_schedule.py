"""Mixture schedules (issue 22, section 1; taught in `nbs/tokens/12k_schedules`): the schedule's integral as a
property, the deficit bound for any items and schedule, and the CLIs a person reaches for (`check-resume` with a
schedule in a JSON or TOML config, with a rescale; `inspect` rebuilding a scheduled loader from its state)."""
import json, os, shutil, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from nanochat_dl.pipe.stages import Stage, Doc
from nanochat_dl.tokens.files import write_token_file
from nanochat_dl.tokens.meta import write_counts
from nanochat_dl.tokens.pieces import Mixer, MixSchedule
from nanochat_dl.tokens.loader import StreamingLoader
from nanochat_dl.tokens.elastic import save_loader_states

CLI = shutil.which('nanochat-dl') or str(Path(sys.executable).parent / 'nanochat-dl')
NAMES = ['a', 'b', 'c']


def cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=600)

point = st.tuples(st.integers(0, 10**7), st.lists(st.integers(0, 50), min_size=3, max_size=3).filter(any))
points = st.lists(point, min_size=1, max_size=6, unique_by=lambda p: p[0]).map(lambda ps: sorted(ps))


@settings(max_examples=200, deadline=None)
@given(points, st.lists(st.integers(0, 2 * 10**7), min_size=2, max_size=20))
def test_the_integral_of_the_shares(pts, Ts):
    "The integrals sum to T, never fall, and grow between two points by the trapezoid of the (linear) shares."
    sc = MixSchedule(pts, NAMES)
    for k, (t, w) in enumerate(pts):                       # at a point: its weights, normalised
        assert sc.at(t)[0] == pytest.approx([x / sum(w) for x in w])
    Ts = sorted(Ts)
    prev = None
    for T in Ts:
        sh, S = sc.at(T)
        assert sum(sh) == pytest.approx(1) and sum(S) == pytest.approx(T, rel=1e-12, abs=1e-6)
        assert all(x >= -1e-9 for x in sh)
        if prev is not None:
            assert all(b >= a - 1e-6 * max(1, T) * 1e-6 for a, b in zip(prev[1], S))
            grid = sorted({prev[0], T, *[t for t, _ in pts if prev[0] < t < T]})   # the share is linear between these
            want = [prev[1][i] + sum((y - x) * (sc.at(x)[0][i] + sc.at(y)[0][i]) / 2 for x, y in zip(grid, grid[1:]))
                    for i in range(3)]
            assert S == pytest.approx(want, rel=1e-9, abs=1e-6)
        prev = (T, S)


class Items(Stage):
    "Items of random sizes in [1, L], forever."
    def __init__(self, L, seed): self.rng, self.L = np.random.default_rng(seed), L
    def __next__(self): return Doc((0,), np.zeros(self.rng.integers(1, self.L + 1)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20_000), st.lists(st.integers(0, 9), min_size=3, max_size=3).filter(all)),
                min_size=1, max_size=5, unique_by=lambda p: p[0]).map(sorted),
       st.lists(st.integers(1, 300), min_size=3, max_size=3), st.integers(0, 10**6))
def test_every_deficit_stays_within_the_bound(pts, Ls, seed):
    "Whatever the items and the schedule, each deficit stays in [-L, (K-1)L] (`12k_schedules`, 'How close')."
    m, L = Mixer([Items(l, seed + i) for i, l in enumerate(Ls)], MixSchedule(pts, NAMES)), max(Ls)
    while sum(m.tokens) < 40_000:
        next(m)
        T = sum(m.tokens)
        d = [t - n for t, n in zip(m.targets(T)[1], m.tokens)]
        assert min(d) >= -L - 1e-6 and max(d) <= 2 * L + 1e-6, (T, d)


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    "A token root of three datasets: web, code, books."
    path, rng, uid, c = tmp_path_factory.mktemp('sched')/'root', np.random.default_rng(0), 1, {}
    for ds, n, mean in [('web', 300, 40), ('code', 150, 60), ('books', 40, 150)]:
        docs = [(np.int64(uid + i) << 12) | (np.arange(l) & 0xFFF) for i, l in enumerate(rng.integers(1, 2 * mean, n))]
        uid += n
        c[(ds, 'a.arrow')] = write_token_file(path/ds/'a.arrow', docs)
    write_counts(path, c)
    return path


SCHED = [[0, {'web': 3, 'code': 1}], [3000, {'web': 3, 'code': 1}], [6000, {'web': 1, 'code': 1, 'books': 2}]]


@pytest.mark.parametrize('fmt', ['json', 'toml'])
def test_check_resume_passes_with_a_schedule_in_the_config(root, tmp_path, fmt):
    cfg = tmp_path/f'sched.{fmt}'
    if fmt == 'json': cfg.write_text(json.dumps({'weights': SCHED, 'shuffle_window': 20, 'pack': 'bestfit'}))
    else:
        cfg.write_text('shuffle_window = 20\npack = "bestfit"\nweights = [[0, {web = 3, code = 1}], '
                       '[3000, {web = 3, code = 1}], [6000, {web = 1, code = 1, books = 2}]]\n')
    r = cli('check-resume', '--loader', 'tokens', '--data', root, '--config', cfg, '-b', 4, '-t', 64, '--batches', 40,
            '--stop', 17, '--world-size-from', 2, '--world-size-to', 3, '--rescale-stop', 20)
    assert r.returncode == 0, r.stdout + r.stderr
    table = r.stdout[r.stdout.index('check '):].splitlines()[1:]
    assert len(table) == 4 and all(' PASS ' in l for l in table), table
    assert table[-1].startswith('rescale 2 -> 3 ranks'), table


def test_a_bad_schedule_in_the_config_exits_2_naming_the_point(root, tmp_path):
    cfg = tmp_path/'bad.json'
    cfg.write_text(json.dumps({'weights': [[0, {'web': 1}], [0, {'code': 1}]]}))
    r = cli('check-resume', '--loader', 'tokens', '--data', root, '--config', cfg, '-b', 4, '-t', 64)
    assert r.returncode == 2 and "weights point 1 [0, {'code': 1}]: tokens_seen 0 is not above point 0's 0" in r.stderr


def test_inspect_rebuilds_a_scheduled_loader_from_its_state(root, tmp_path):
    "The state's config holds the schedule: `inspect` replays the steps as the run made them."
    kw = dict(weights=SCHED, shuffle_window=20, pack='bestfit', bos_token=1, device='cpu')
    with StreamingLoader(root, 64, 4, **kw) as ld:
        rows = []
        for step in range(30):
            b = next(ld)
            rows.append(b.inputs.numpy().copy())
            if step == 19: save_loader_states(tmp_path/'ckpt'/'step19', b.state, step, rank=0, world_size=1)
    assert b.metrics['target_shares']['books'] > 0            # the ramp reached
    from nanochat_dl.bench.replay import loader_from_state
    from nanochat_dl.tokens.elastic import load_loader_states
    st = load_loader_states(tmp_path/'ckpt'/'step19', step=19)[0]
    assert st['config']['weights'] == [[0, [0, 1, 3]], [3000, [0, 1, 3]], [6000, [2, 1, 1]]]
    with loader_from_state(st, root) as ld:
        for step in range(20, 30): assert (next(ld).inputs.numpy() == rows[step]).all(), step
    r = cli('inspect', tmp_path/'ckpt', '--steps', '24..25', '--data', root)
    assert r.returncode == 0 and 'step 24' in r.stdout and 'step 25' in r.stdout, r.stderr
