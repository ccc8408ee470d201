"""Elastic resume of the pre-tokenized loader (nbs/tokens/13_elastic.ipynb): a run saved at one world size (ranks, DataLoader
workers) and resumed at another still delivers every token of every document of an epoch exactly once. In-process
simulations of chains of rescales (8 -> 3 -> 5, 1 -> 1,024 -> 7, workers changing, every pack mode, shuffle and mixing
on), a hypothesis property over random chains, a real `torchrun` job at 2 -> 3 -> 2 ranks, and the checkpoint helper."""
import itertools, json, os, re, subprocess, sys, types
from collections import defaultdict
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

from nanochat_dl.tokens.root import TokenRoot
from nanochat_dl.tokens import World, load_loader_states, loader_state_path, save_loader_states, unit_states
from nanochat_dl.tokens import PACKS, DocKey, StreamingDataset, StreamingLoader, stream_config
from test_streaming import SPEC, assert_tiles, open_epochs, toy_root

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

KW = dict(weights=[1, 2, 3], bos_token=1, eos_token=2, sep_token=3, n_logical_shards=24, shuffle_window=20,
          max_chunk=50, pack_buffer=12)
T, B = 24, 3


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return toy_root(tmp_path_factory.mktemp('elastic')/'root', SPEC)


@pytest.fixture(scope='module')
def big(tmp_path_factory):
    # enough documents that each of 1,024 logical shards holds some: every one of 1,024 ranks owns a document
    return toy_root(tmp_path_factory.mktemp('elastic')/'big', {'big': {'a.arrow': 1100, 'b.arrow': 1000}, 'small': {'c.arrow': 300}},
                    empty=0.0, mean=20, T=32)


# ---------------------------------------------------------------- a simulated world: ranks, each of some DataLoader workers

class Unit:
    "One unit of work in process: a rank's `StreamingLoader`, or (with workers) one worker's stream of a rank's `StreamingDataset`."
    def __init__(self, tr, r, W, w, nw, **kw):
        self.w, self.nw = w, nw
        if nw == 1: self.ld, self.ds = StreamingLoader(tr, T, B, rank=r, world_size=W, prefetch=0, **kw), None
        else: self.ld, self.ds = None, StreamingDataset(tr, T, rank=r, world_size=W, **kw)

    def _as_worker(self):
        return mock.patch('torch.utils.data.get_worker_info', return_value=types.SimpleNamespace(id=self.w, num_workers=self.nw))

    def load(self, state):
        if self.ld is not None: return self.ld.load_state_dict(state)
        self.ds.load_state_dict(state)
        with self._as_worker(): self.ds._ensure()

    def state(self) -> dict:
        if self.ld is not None: return self.ld.state_dict()
        with self._as_worker(): return self.ds.state_dict()

    def batch(self):
        "(rows, segments) of the next batch"
        if self.ld is not None:
            b = self.ld.__next__()
            return b.rows, b.segments
        with self._as_worker():
            s = self.ds._ensure()
            p = s.next_rows(B)
            return p.rows, s.doc_segments(p)

    def close(self):
        if self.ld is not None: self.ld.close()


def deliver(u, tr, cov, n=None, epochs=1, log=None):
    "Take `n` batches from unit `u` (None: until its first `epochs` are closed); each segment checked against its file, kept in `cov`."
    k = 0
    while (k < n) if n is not None else min(open_epochs(u.state()).values()) <= epochs:
        rows, segs = u.batch()
        k += 1
        for r, row in enumerate(segs):
            for s in row:
                d = s.key
                assert np.array_equal(rows[r, s.start:s.start + s.length], tr.doc(d.dataset, d.file, d.doc)[s.offset:s.offset + s.length])
                if d.epoch <= epochs: cov[d].append((s.offset, s.length))
                if log is not None: log.append(d)
        assert k < 100_000
    return k


def ranks_after(tr, W, n, **kw) -> list:
    "`W` ranks (no workers), each having delivered `n` batches."
    units = [Unit(tr, r, W, 0, 1, **kw) for r in range(W)]
    for u in units: deliver(u, tr, defaultdict(list), n)
    return units


def chain(tr, worlds, steps, kw, cov=None, direct=True):
    """Run a chain of worlds, `worlds[j] = (ranks, workers per rank)`: world j takes `steps[j]` batches per unit and saves;
    world j+1 resumes from the list of all those states; the last world runs until epoch 1 is closed everywhere.
    `direct`: each unit loads the list itself (else `World.states_for` once, and each unit its own dict)."""
    cov, states = defaultdict(list) if cov is None else cov, None
    for j, (W, nw) in enumerate(worlds):
        units = [Unit(tr, r, W, w, nw, **kw) for r in range(W) for w in range(nw)]
        if states is not None:
            if direct:
                for u in units: u.load(states)
            else:
                c = units[0].ld.config if units[0].ld else units[0].ds.config
                fp = units[0].ld.fingerprint if units[0].ld else units[0].ds.fingerprint
                for u, s in zip(units, World(states, tr, c, fp).states_for(W, nw)): u.load(s)
        for u in units: deliver(u, tr, cov, steps[j] if j < len(worlds) - 1 else None)
        states = [u.state() for u in units]
        for u in units: u.close()
    return cov


def test_chain_without_workers_matches_the_issue(root):
    tr = TokenRoot(root)
    assert_tiles(chain(tr, [(8, 1), (3, 1), (5, 1)], [3, 5], dict(KW, pack='bestfit')), tr, 1)
    assert_tiles(chain(tr, [(3, 1), (5, 1), (2, 1)], [4, 3], dict(KW, pack='concat')), tr, 1)
    assert_tiles(chain(tr, [(8, 1), (1, 1)], [6], dict(KW, pack='pad')), tr, 1)


@pytest.mark.parametrize('pack', list(PACKS))
def test_two_rescales_in_a_row_every_pack_mode(root, pack):
    # the second rescale comes before the first world's buffered pieces have all gone: they move twice
    tr = TokenRoot(root)
    assert_tiles(chain(tr, [(2, 1), (7, 1), (4, 1), (3, 1)], [5, 1, 1], dict(KW, pack=pack)), tr, 1)


@pytest.mark.parametrize('pack', list(PACKS))
def test_worker_counts_change(root, pack):
    # ranks x workers: 2x2 -> 3x1 -> 1x4 -> 2x3
    tr = TokenRoot(root)
    assert_tiles(chain(tr, [(2, 2), (3, 1), (1, 4), (2, 3)], [4, 3, 2], dict(KW, pack=pack)), tr, 1)


def test_no_shuffle_no_cutting_no_delimiters(root):
    tr = TokenRoot(root)
    kw = dict(n_logical_shards=10, shuffle_window=0, pack='concat')
    assert_tiles(chain(tr, [(3, 1), (10, 1), (2, 1)], [7, 2], kw), tr, 1)


def test_two_epochs_across_rescales(root):
    # the first world runs into epoch 2 on some shards; the segments of epochs 1 and 2 each tile the data
    tr = TokenRoot(root)
    kw = dict(KW, pack='bestfit', n_logical_shards=12, shuffle_window=6)
    cov = defaultdict(list)
    units = [Unit(tr, r, 2, 0, 1, **kw) for r in range(2)]
    for u in units: deliver(u, tr, cov, 60, epochs=2)
    assert {k.epoch for k in cov} == {1, 2}
    states = [u.state() for u in units]
    units = [Unit(tr, r, 5, 0, 1, **kw) for r in range(5)]
    for u in units: u.load(states); deliver(u, tr, cov, None, epochs=2)
    assert_tiles(cov, tr, 2)


def test_a_rank_with_only_finished_shards_runs_on(root):
    # one rank reads most of epoch 1; after a rescale to 24 ranks (one logical shard each) some ranks own only
    # finished shards: they start their shards' next epoch at once, and the epoch still tiles
    tr = TokenRoot(root)
    kw = dict(datasets='web', bos_token=1, n_logical_shards=24, shuffle_window=5, pack='concat')
    cov = defaultdict(list)
    u = Unit(tr, 0, 1, 0, 1, **kw)
    for _ in range(100):                                  # read on until some rank of 24 would own only finished shards
        deliver(u, tr, cov, 10)
        states = [u.state()]
        dealt = World(states, tr, u.ld.config, u.ld.fingerprint).states_for(24)
        if any(min(open_epochs(s).values()) > 1 for s in dealt): break
    assert min(open_epochs(states[0]).values()) == 1       # the epoch is not over
    units = [Unit(tr, r, 24, 0, 1, **kw) for r in range(24)]
    for x in units: x.load(states)
    done = [x for x in units if min(open_epochs(x.state()).values()) > 1]
    assert done
    log = []
    deliver(done[0], tr, cov, 1, log=log)
    assert log and all(k.epoch == 2 for k in log)
    for x in units: deliver(x, tr, cov)
    assert_tiles(cov, tr, 1, ['web'])


def test_list_load_equals_the_world_deal(root):
    # a rank given the list computes the same state as World.states_for does for every rank at once
    tr = TokenRoot(root)
    kw = dict(KW, pack='bestfit')
    units = ranks_after(tr, 3, 4, **kw)
    states = [u.state() for u in units]
    ld = StreamingLoader(tr, T, B, rank=2, world_size=5, prefetch=0, **kw)
    dealt = World(states, tr, ld.config, ld.fingerprint).states_for(5)
    assert ld.load_state_dict(states).state_dict() == dealt[2]
    # at the world size it was saved in, each rank gets its own state back, and resumes exactly
    same = StreamingLoader(tr, T, B, rank=1, world_size=3, prefetch=0, **kw).load_state_dict(states)
    assert same.state_dict() == states[1]
    assert np.array_equal(next(same).rows, units[1].batch()[0])


def test_mix_counters_carry_over(root):
    tr = TokenRoot(root)
    kw = dict(KW, pack='bestfit')
    units = ranks_after(tr, 3, 5, **kw)
    old = [u.state() for u in units]
    new = World(old, tr, units[0].ld.config, units[0].ld.fingerprint).states_for(7)
    for d in old[0]['datasets']:
        assert sum(s['datasets'][d]['tokens'] for s in new) == sum(s['datasets'][d]['tokens'] for s in old) > 0


def test_1_to_1024_to_7_ranks(big):
    # in pytest under a minute on one core: 1 rank -> 1,024 ranks (each loads the list) -> 7 ranks (dealt once)
    tr = TokenRoot(big)
    kw = dict(bos_token=1, eos_token=2, n_logical_shards=1024, shuffle_window=4, max_chunk=20, pack='bestfit', pack_buffer=4, weights=[3, 1])
    cov = defaultdict(list)
    u = Unit(tr, 0, 1, 0, 1, **kw)
    deliver(u, tr, cov, 40)
    states = [u.state()]
    units = [Unit(tr, r, 1024, 0, 1, **kw) for r in range(1024)]
    for x in units: x.load(states)
    for x in units: deliver(x, tr, cov, 1)
    states = [x.state() for x in units]
    for x in units: x.close()
    assert len({s['run'] for s in states}) == 1
    seven = [Unit(tr, r, 7, 0, 1, **kw) for r in range(7)]
    for x, s in zip(seven, World(states, tr, seven[0].ld.config, seven[0].ld.fingerprint).states_for(7)): x.load(s)
    for x in seven: deliver(x, tr, cov)
    assert_tiles(cov, tr, 1)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(pack=st.sampled_from(list(PACKS)), window=st.sampled_from([0, 3, 20]), max_chunk=st.sampled_from([None, 17, 50]),
       shards=st.integers(8, 30), seed=st.integers(0, 3),
       worlds=st.lists(st.tuples(st.integers(1, 6), st.sampled_from([1, 1, 2, 3])), min_size=2, max_size=4),
       steps=st.lists(st.integers(0, 25), min_size=3, max_size=3))
@example(pack='pad', window=0, max_chunk=17, shards=29, seed=1, worlds=[(3, 1), (6, 3)], steps=[23, 6, 7])   # a unit owning only an empty shard of 'books'
def test_exactly_once_over_random_chains_hypothesis(root, pack, window, max_chunk, shards, seed, worlds, steps):
    worlds = [(W, nw) for W, nw in worlds if W * nw <= shards] or [(1, 1), (2, 1)]
    if len(worlds) < 2: worlds.append((1, 1))
    tr = TokenRoot(root)
    kw = dict(weights=[1, 2, 3], bos_token=1, eos_token=2, n_logical_shards=shards, shuffle_window=window, max_chunk=max_chunk,
              pack=pack, pack_buffer=6, seed=seed)
    assert_tiles(chain(tr, worlds, steps, kw), tr, 1)


# ---------------------------------------------------------------- a real DataLoader whose number of workers changes

def stateful_state(root, kw, n):
    "The state of a `StatefulDataLoader` of two workers over the stream, after `n` rows."
    from torchdata.stateful_dataloader import StatefulDataLoader
    dl = StatefulDataLoader(StreamingDataset(root, T, **kw), batch_size=1, num_workers=2)
    it = iter(dl)
    for _ in range(n): next(it)
    return dl.state_dict()


def test_stateful_dataloader_from_2_to_3_workers(root):
    from torchdata.stateful_dataloader import StatefulDataLoader
    tr = TokenRoot(root)
    kw = dict(KW, pack='bestfit')
    sd = stateful_state(root, kw, 9)
    # what the three new workers must deliver: the simulated units, dealt the same states, taken in turn
    cfg, fp = stream_config(tr, T, **kw)[1:]
    units = [Unit(tr, 0, 1, w, 3, **kw) for w in range(3)]
    for u, s in zip(units, World([sd], tr, cfg, fp).states_for(1, 3)): u.load(s)
    ds = StreamingDataset(root, T, **kw)
    ds.load_state_dict([sd])
    got = [torch.cat([x[0], y[0, -1:]]).numpy() for x, y in itertools.islice(StatefulDataLoader(ds, batch_size=1, num_workers=3), 12)]
    want = [units[i % 3].ds._stream.next_rows(1).rows[0] for i in range(12)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize('ctx', ['fork', 'spawn'])
def test_a_loaded_state_survives_use_in_the_parent(root, ctx):
    "A `StreamingDataset` given a list of states and then used in the process that holds it (`state_dict()` builds its stream there) still hands the loaded state to the DataLoader's workers, forked or spawned: they resume, not start over."
    from torchdata.stateful_dataloader import StatefulDataLoader
    kw = dict(KW, pack='bestfit')
    rows = lambda it, n: [x.clone() for x, _ in itertools.islice(it, n)]
    dl = StatefulDataLoader(StreamingDataset(root, T, **kw), batch_size=1, num_workers=2)
    it = iter(dl)
    rows(it, 8)                                                  # (even: the next row is worker 0's, as in a new loader)
    sd, want = dl.state_dict(), rows(it, 8)
    del it, dl
    ds = StreamingDataset(root, T, **kw)
    ds.load_state_dict([sd])
    ds.state_dict()                                              # the state, loaded into this process's stream
    got = rows(StatefulDataLoader(ds, batch_size=1, num_workers=2, multiprocessing_context=ctx, timeout=120), 8)
    assert len(got) == 8 and all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------- refusals

def test_states_of_two_runs_or_steps_are_refused(root):
    tr = TokenRoot(root)
    kw = dict(KW, pack='bestfit')
    a = [Unit(tr, r, 2, 0, 1, **kw) for r in range(2)]
    for u in a: deliver(u, tr, defaultdict(list), 3)
    sa = [u.state() for u in a]
    deliver(a[1], tr, defaultdict(list), 1)
    late = a[1].state()
    ld = StreamingLoader(tr, T, B, rank=0, world_size=3, prefetch=0, **kw)
    with pytest.raises(ValueError, match=r"states\[1\] is at step 4, states\[0\] at step 3: the states of two steps mixed"):
        ld.load_state_dict([sa[0], late])
    # a resumed run at another world size is a new run: its states do not mix with the old run's
    c = [Unit(tr, r, 3, 0, 1, **kw) for r in range(3)]
    for u in c: u.load(sa)
    sc = [u.state() for u in c]
    with pytest.raises(ValueError, match="from world sizes \\[2, 3\\]"):
        ld.load_state_dict(sa + sc)
    other = dict(sc[1], run='0123456789abcdef', config=dict(sc[1]['config']))
    with pytest.raises(ValueError, match=r"states\[1\] is of run '0123456789abcdef', states\[0\] of run '.*': the states of two runs mixed"):
        ld.load_state_dict([sc[0], other, sc[2]])
    with pytest.raises(ValueError, match=r"the state of rank 1 of 3 is missing"):
        ld.load_state_dict([sc[0], sc[2]])
    with pytest.raises(ValueError, match=r"states\[0\] and states\[1\] are both rank 0 of 3"):
        ld.load_state_dict([sc[0], sc[0], sc[2]])


# ---------------------------------------------------------------- the checkpoint helper

def test_save_and_load_loader_states(root, tmp_path):
    tr = TokenRoot(root)
    kw = dict(KW, pack='bestfit')
    units = ranks_after(tr, 3, 2, **kw)
    states = [u.state() for u in units]
    for r, s in enumerate(states): save_loader_states(tmp_path/'step2', s, 2, rank=r, world_size=3)
    assert sorted(p.name for p in (tmp_path/'step2').iterdir()) == [loader_state_path('.', r, 3).name for r in range(3)]
    assert load_loader_states(tmp_path/'step2', step=2) == states
    with pytest.raises(ValueError, match="holds the loader states of step 2, expected step 5"): load_loader_states(tmp_path/'step2', step=5)
    # a file of another step copied in
    for u in units: deliver(u, tr, defaultdict(list), 1)
    save_loader_states(tmp_path/'mixed', states[0], 2, rank=0, world_size=3)
    for r in (1, 2): save_loader_states(tmp_path/'mixed', units[r].state(), 3, rank=r, world_size=3)
    with pytest.raises(ValueError, match=r"rank00001-of-00003.json is of step 3, .*rank00000-of-00003.json of step 2: the loader states of two steps mixed"):
        load_loader_states(tmp_path/'mixed')
    # a rank missing; two world sizes in one folder; a file renamed
    (tmp_path/'step2'/loader_state_path('.', 1, 3).name).unlink()
    with pytest.raises(FileNotFoundError, match=r"rank00001-of-00003.json is missing"): load_loader_states(tmp_path/'step2')
    save_loader_states(tmp_path/'step2', states[0], 2, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"world sizes \[2, 3\]"): load_loader_states(tmp_path/'step2')
    p = tmp_path/'ren'; save_loader_states(p, states[0], 2, rank=0, world_size=1)
    (p/loader_state_path('.', 0, 1).name).rename(p/loader_state_path('.', 0, 2).name)
    with pytest.raises(ValueError, match="its name says rank 0 of 2, its header rank 0 of 1"): load_loader_states(p)


def test_save_is_atomic(root, tmp_path, monkeypatch):
    # a write that fails half way leaves the old file whole and no temporary file behind
    save_loader_states(tmp_path, {'any': 'json', 'n': [1, 2]}, 7, rank=0, world_size=1)
    before = loader_state_path(tmp_path, 0, 1).read_text()
    monkeypatch.setattr('nanochat_dl.core.os.replace', lambda *a: (_ for _ in ()).throw(OSError('disk full')))
    with pytest.raises(OSError, match='disk full'): save_loader_states(tmp_path, {'any': 'other'}, 8, rank=0, world_size=1)
    monkeypatch.undo()
    assert loader_state_path(tmp_path, 0, 1).read_text() == before and len(list(tmp_path.iterdir())) == 1
    assert load_loader_states(tmp_path) == [{'any': 'json', 'n': [1, 2]}]



def test_damaged_checkpoint_folders_are_refused_naming_the_file(tmp_path):
    """A file for a rank that another file already holds (a name padded otherwise, a copy), a header claiming a world of 2**40
    ranks, a file of JSON nested too deep: each refused naming the file, without hanging or a RecursionError."""
    for r in range(2): save_loader_states(tmp_path/'a', {'format': 'x', 'r': r}, 5, rank=r, world_size=2, run='R')
    p0 = loader_state_path(tmp_path/'a', 0, 2)
    h = json.loads(p0.read_text()); h['state']['r'] = 7
    (tmp_path/'a'/'loader_state.rank0-of-2.json').write_text(json.dumps(h))
    with pytest.raises(ValueError, match=r"loader_state\.rank0-of-2\.json and .*loader_state\.rank00000-of-00002\.json are both rank 0 of 2"):
        load_loader_states(tmp_path/'a')
    W = 2 ** 40
    save_loader_states(tmp_path/'b', {'format': 'x'}, 5, rank=0, world_size=W)
    with pytest.raises(FileNotFoundError, match=rf"rank00001-of-{W}\.json is missing: the save of {W} ranks lacks rank\(s\) \[1, 2, 3, 4, 5, 6, 7, 8\] \(and {W - 9} more\)"):
        load_loader_states(tmp_path/'b')
    p0.write_text('[' * 100_000 + ']' * 100_000)
    with pytest.raises(ValueError, match=r"rank00000-of-00002\.json is not a JSON loader state: .*nested too deep"):
        load_loader_states(tmp_path/'a')
    for bad in ('5', 5.0, True):
        with pytest.raises(ValueError, match=rf"step={bad!r:.5} is invalid: expected an int >= 0"): load_loader_states(tmp_path/'b', step=bad)


def test_lists_with_huge_counts_or_odd_steps_are_refused_naming_the_state(root):
    """In a list of states, a step that is no int (with DataLoader workers, where steps may differ), n_workers or world_size of
    2**40 in every state, a state of another world size: refused naming the state, never a raw TypeError or a hang."""
    tr = TokenRoot(root)
    kw = dict(KW, pack='bestfit')
    sa = [u.state() for u in ranks_after(tr, 2, 2, **kw)]
    ld = StreamingLoader(tr, T, B, rank=0, world_size=3, prefetch=0, **kw)
    for step in (None, 'x', 1.5, {}):
        bad = json.loads(json.dumps(sa)); bad[0]['step'] = bad[1]['step'] = step
        with pytest.raises(ValueError, match=re.escape(f"states[0]['step']={step!r} is invalid: expected an int >= 0")): ld.load_state_dict(bad)
    for k, msg in (('n_workers', r"the state of rank 0 of 2, worker 1 of 1099511627776 is missing \(2199023255550 missing in all\)"),
                   ('world_size', r"the state of rank 2 of 1099511627776 is missing \(1099511627774 missing in all\)")):
        bad = json.loads(json.dumps(sa))
        for s in bad: s['config'][k] = 2 ** 40
        with pytest.raises(ValueError, match=msg): ld.load_state_dict(bad)
    bad = json.loads(json.dumps(sa)); bad[1]['config']['world_size'] = 1; bad[1]['config']['rank'] = 0
    with pytest.raises(ValueError, match=r"states\[1\] is of world size 1, states\[0\] of world size 2: expected the states of every rank of one save"):
        ld.load_state_dict(bad)

# ---------------------------------------------------------------- real processes: torchrun 2 -> 3 -> 2

@pytest.mark.timeout(600)
def test_torchrun_2_3_2_tiles_the_epoch(root, tmp_path):
    script = Path(__file__).parent / 'elastic_ddp.py'
    env = dict(os.environ, OMP_NUM_THREADS='1')
    def phase(n, name, steps, resume=None):
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', str(n),
               str(script), str(root), str(tmp_path), name, str(steps)] + ([str(resume)] if resume else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        return [json.loads((tmp_path/name/f'segments.rank{k}.json').read_text()) for k in range(n)]
    runs = [phase(2, 'a', 6), phase(3, 'b', 4, tmp_path/'a'/'ckpt'), phase(2, 'c', -1, tmp_path/'b'/'ckpt')]
    assert [len(p) for p in runs] == [2, 3, 2] and [p[0]['world'] for p in runs] == [2, 3, 2]
    assert [x['batches'] for x in runs[0] + runs[1]] == [6, 6, 4, 4, 4]
    cov = defaultdict(list)
    for p in runs:
        for x in p:
            for ds, f, g, e, off, n in x['segments']:
                if e == 1: cov[DocKey(ds, f, g, e)].append((off, n))
    assert_tiles(cov, TokenRoot(root), 1)
    # every rank of every phase delivered some of epoch 1, and the saves carry one run id per phase
    heads = [[json.loads(p.read_text()) for p in sorted((tmp_path/x/'ckpt').iterdir())] for x in 'abc']
    assert [len({h['run'] for h in hs}) for hs in heads] == [1, 1, 1]
    assert len({hs[0]['run'] for hs in heads}) == 3


def test_stateful_dataloader_states_are_named_by_their_path(root):
    "A bad field in a `StatefulDataLoader`'s state is named where it is in that state (the rank's entry, the worker, the field), not by its place in a flattened list (`states[1]`)."
    import copy, re
    kw = dict(KW, pack='bestfit')
    sd = stateful_state(root, kw, 4)
    ld = StreamingLoader(root, T, B, prefetch=0, **kw)
    w1 = "states[0]['_snapshot']['_worker_snapshots']['worker_1']['dataset_state']"
    bad = copy.deepcopy(sd); bad['_snapshot']['_worker_snapshots']['worker_1']['dataset_state']['step'] = 'x'
    with pytest.raises(ValueError, match=re.escape(f"{w1}['step']='x' is invalid")): ld.load_state_dict([bad])
    bad = copy.deepcopy(sd); ds1 = bad['_snapshot']['_worker_snapshots']['worker_1']['dataset_state']
    del ds1['datasets']['code']
    with pytest.raises(ValueError, match=re.escape(f"{w1}['datasets']['code'] is missing")): ld.load_state_dict([bad])
    bad = copy.deepcopy(sd); bad['_snapshot']['_worker_snapshots']['worker_0']['dataset_state']['run'] = '0123456789abcdef'
    with pytest.raises(ValueError, match=re.escape("states[0]['_snapshot']['_worker_snapshots']['worker_1']['dataset_state'] is of run")):
        ld.load_state_dict([bad])
