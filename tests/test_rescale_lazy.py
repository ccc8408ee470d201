"""A rescale reads again only the saved units it needs (nbs/tokens/12h_world.ipynb, `World(lazy=True)`): a new unit's
state is made from the old units whose logical shards it will own, and equals, field for field, the state that reading
every old unit again (`lazy=False`, the reference) makes; the batches after it are the same."""

import numpy as np
import pytest

from nanochat_dl.tokens.root import TokenRoot
from nanochat_dl.tokens import World, owned_shards
from nanochat_dl.tokens.fast import FastTokenStream
from test_elastic import KW, Unit
from lazyrescale import saved_units
from test_streaming import SPEC, toy_root

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return toy_root(tmp_path_factory.mktemp('lazy')/'root', SPEC)


def saved(tr, W, nw, n, **kw):
    "Every unit's state of a world of `W` ranks of `nw` workers, each having delivered `n` batches (workers: `n + k % 3`)."
    states, cfg, fp = saved_units(tr, W, nw, lambda k: n + (k % 3 if nw > 1 else 0), **kw)
    if nw > 1: states = [dict(_snapshot=dict(_worker_snapshots={f'worker_{w}': dict(dataset_state=states[r * nw + w])
                                                                for w in range(nw)})) for r in range(W)]
    return states, cfg, fp


# (old world, new world, batches before the save): ranks of workers
CHANGES = [((2, 1), (3, 1), 5), ((4, 1), (3, 1), 7), ((1, 1), (4, 1), 13), ((2, 2), (3, 1), 4), ((3, 1), (2, 3), 9),
           ((2, 2), (1, 3), 6)]


@pytest.mark.parametrize('pack', ['bestfit', 'concat'])
@pytest.mark.parametrize('old,new,n', CHANGES)
def test_lazy_states_equal_the_full_expansion(root, pack, old, new, n):
    tr = TokenRoot(root)
    states, cfg, fp = saved(tr, *old, n, **dict(KW, pack=pack))
    (W, nw), full = new, World(states, tr, cfg, fp, lazy=False)
    want = full.states_for(W, nw)
    assert World(states, tr, cfg, fp).states_for(W, nw) == want           # one lazy world dealing every unit
    for k, (r, w) in enumerate((r, w) for r in range(W) for w in range(nw)):
        assert World(states, tr, cfg, fp).state_for(r, W, w, nw) == want[k]   # each rank on its own, as in a job
    # the batches after: a unit resumed from the lazy state and one from the full state deliver the same rows
    for k, (r, w) in enumerate([(0, 0), (W - 1, nw - 1)]):
        a, b = (Unit(tr, r, W, w, nw, **dict(KW, pack=pack)) for _ in range(2))
        a.load(World(states, tr, cfg, fp).state_for(r, W, w, nw)); b.load(want[r * nw + w])
        for _ in range(4):
            (ra, sa), (rb, sb) = a.batch(), b.batch()
            assert np.array_equal(ra, rb) and sa == sb
        assert a.state() == b.state()
        a.close(); b.close()


def test_lazy_reads_again_only_the_units_it_needs(root, monkeypatch):
    tr = TokenRoot(root)
    states, cfg, fp = saved(tr, 4, 2, 3, **dict(KW, pack='bestfit'))       # 8 old units of 3 logical shards each
    made = []                                # a unit read again: its state loaded (a /5 bestfit load replays in a
    real = FastTokenStream.load_state        # second stream of its own, not counted)
    def counted(self, st, *a, **k):
        made.append((self.cfg['rank'], self.cfg['world_size'])); return real(self, st, *a, **k)
    monkeypatch.setattr(FastTokenStream, 'load_state', counted)
    world = World(states, tr, cfg, fp)
    assert made == []                                                        # nothing read again
    made.clear()
    world.state_for(0, 3)                                                    # shards 0..7: old units 0, 1, 2
    assert sorted(made) == [(0, 4), (0, 4), (1, 4)]
    made.clear()
    world.state_for(0, 3)                                                    # cached
    assert made == []
    S = cfg['n_logical_shards']
    need = [u for u, o in enumerate(owned_shards(S, r, 4, w, 2) for r in range(4) for w in range(2))
            if set(o) & set(owned_shards(S, 2, 3))]
    world.state_for(2, 3)
    assert len(made) == len([u for u in need if u not in (0, 1, 2)])


def test_a_bad_unit_is_named_by_the_rank_that_needs_it(root):
    tr = TokenRoot(root)
    states, cfg, fp = saved(tr, 2, 1, 4, **dict(KW, pack='concat'))
    from nanochat_dl.pipe.state import seal
    bad = [states[0], seal(dict(states[1], datasets=dict(states[1]['datasets'], web=dict(states[1]['datasets']['web'],
                                                                                           window=[0, 10**6]))))]
    world = World(bad, tr, cfg, fp)                                          # (the block is read again when needed)
    world.state_for(0, 3)                                                    # rank 0 of 3 needs old rank 0 only
    with pytest.raises(ValueError, match=r"states\[1\]\['datasets'\]\['web'\]\['window'\]"): world.state_for(2, 3)
    with pytest.raises(ValueError, match=r"states\[1\]\['datasets'\]\['web'\]\['window'\]"):
        World(bad, tr, cfg, fp, lazy=False)
    # unsealed: the field is still named first, not the checksum
    raw = [states[0], dict(bad[1], checksum=states[1].get('checksum'))]
    with pytest.raises(ValueError, match=r"states\[1\]\['datasets'\]\['web'\]\['window'\]"): World(raw, tr, cfg, fp)


def test_a_piece_held_by_two_units_is_refused_by_every_rank(root):
    # unit 1's packer entries copied into unit 0: refused when the world is made (addresses only, no block read again),
    # whichever rank makes it, as the full expansion refuses it. (Over block windows a bestfit state names its inputs by
    # number, format /5, and holds no entries: they are named when its unit is read again; reservoir states name them.)
    tr = TokenRoot(root)
    states, cfg, fp = saved(tr, 2, 1, 6, **dict(KW, pack='bestfit', shuffle='reservoir'))
    from nanochat_dl.pipe.state import seal
    assert states[1]['packer']['entries']
    bad = [seal(dict(states[0], packer=states[1]['packer'])), states[1]]
    for lazy in (True, False):
        with pytest.raises(ValueError, match=r"states\[0\]\['packer'\]\['entries'\]\[0\]: document"):
            World(bad, tr, cfg, fp, lazy=lazy).state_for(0, 3)
