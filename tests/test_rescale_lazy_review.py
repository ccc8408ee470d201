"""An adversary's review of the lazy rescale (nbs/tokens/12h_world.ipynb, `World(lazy=True)`): what the full expansion
(`lazy=False`, the reference) refuses, every lazy rank refuses too, and what it deals, a lazy rank deals the same."""
from collections import defaultdict

import pytest

from nanochat_dl.pipe.state import runs_of, seal
from nanochat_dl.tokens.root import TokenRoot
from nanochat_dl.tokens import World, owned_shards, unit_states
from test_elastic import KW, Unit, deliver
from lazyrescale import saved_units, assert_refused_by_every_rank
from test_streaming import SPEC, toy_root

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture(scope='module')
def root(tmp_path_factory):
    return toy_root(tmp_path_factory.mktemp('lazyreview')/'root', SPEC)


def idle(states, S):
    "The index of the first state whose unit walks no logical shard."
    return next(j for j, s in enumerate(states) if not len(owned_shards(S, s['config']['rank'], s['config']['world_size'],
                                                                        s['config']['worker'], s['config']['n_workers'])))


def tampered(s, how, other):
    "State `s` (of a unit of no logical shard) made to hold what it cannot, resealed; `other` a unit's state that walks shards."
    web = s['datasets']['web']
    if how == 'window': d = dict(web, window=[0, 10**6])                       # a block window's cursor beyond the data
    elif how == 'parked': d = dict(web, parked=[[other['packer']['entries'][0][1], 1, 0]])
    elif how == 'cut': d = dict(web, cut=[5, 1, 0])
    if how == 'entry':                                                         # a packer entry naming no document
        return seal(dict(s, packer=dict(s['packer'], entries=[[2, 10**6, 1, 0, 0]])))
    return seal(dict(s, datasets=dict(s['datasets'], web=d)))


@pytest.mark.parametrize('how,shuffle', [('parked', 'reservoir'), ('cut', 'reservoir'), ('entry', 'reservoir'),
                                         ('cut', 'block')])
def test_a_tampered_unit_of_no_shard_is_refused_by_every_rank(root, how, shuffle):
    # 13 ranks of 2 workers over 24 logical shards: two workers walk none; the full expansion reads them again and
    # refuses what they cannot hold; a lazy rank never needs them, and must refuse it all the same
    # (reservoir windows: a bestfit state over block windows names its packer's inputs by number, format /5, no entries)
    tr = TokenRoot(root)
    states, cfg, fp = saved_units(tr, 13, 2, 2, **dict(KW, pack='bestfit', shuffle=shuffle))
    j = idle(states, cfg['n_logical_shards'])
    other = next((s for s in states if s['packer'].get('entries') and s['packer']['entries'][0][0] == 2), None)
    bad = list(states); bad[j] = tampered(states[j], how, other)
    assert_refused_by_every_rank(bad, tr, cfg, fp, j)


def test_units_of_no_shard_deal_as_the_full_expansion(root):
    tr = TokenRoot(root)
    states, cfg, fp = saved_units(tr, 13, 2, 2, **dict(KW, pack='bestfit'))
    want = World(states, tr, cfg, fp, lazy=False).states_for(3)
    assert [World(states, tr, cfg, fp).state_for(r, 3) for r in range(3)] == want


def runs(rle): return [v for v, c in rle for _ in range(c)]


def held_twice(a, b, how):
    "State `a` made to hold a piece `b` holds (of `b`'s shards), resealed: in its window, as its cut or as a piece parked."
    d, other = dict(a['datasets']['code']), b['datasets']['code']
    if how == 'window':
        w, o = d['shuffle'], other['shuffle']
        d['shuffle'] = dict(w, doc=w['doc'] + o['doc'][:1], epoch=runs_of(runs(w['epoch']) + runs(o['epoch'])[:1]),
                            start=runs_of(runs(w['start']) + runs(o['start'])[:1]))
    elif how == 'cut': d['cut'] = other['cut']
    else: d['parked'] = [[o, e, 0] for o, e in zip(other['shuffle']['doc'][:1], runs(other['shuffle']['epoch']))]
    return seal(dict(a, datasets=dict(a['datasets'], code=d)))


@pytest.mark.parametrize('how', ['window', 'cut', 'parked'])
def test_a_piece_held_by_two_units_in_a_window_cut_or_parked_is_refused_by_every_rank(root, how):
    # reservoir windows, cuts and pieces parked are named in the states as saved: a piece of old rank 1's shards held by
    # old rank 0 is refused by every new rank, as the full expansion refuses it (rank 2 of 3 needs only old rank 1)
    tr = TokenRoot(root)
    states, cfg, fp = saved_units(tr, 2, 1, 5, **dict(KW, pack='bestfit', shuffle='reservoir'))
    assert states[1]['datasets']['code']['cut'] and states[1]['datasets']['code']['shuffle']['doc']
    bad = [held_twice(states[0], states[1], how), states[1]]
    assert_refused_by_every_rank(bad, tr, cfg, fp, 0)


def test_a_dealt_state_shares_nothing_with_the_world_or_another_state(root):
    # one world deals many units (a job's rank reuses it for its workers, `states_for` for every unit): what one caller
    # does to the state it got (its config's weights, datasets, tokens stripped) changes no other state, nor what comes next
    tr = TokenRoot(root)
    states, cfg, fp = saved_units(tr, 2, 2, 3, **dict(KW, pack='bestfit'))
    want = World(states, tr, cfg, fp, lazy=False).states_for(3)
    for lazy in (True, False):
        world = World(states, tr, cfg, fp, lazy=lazy)
        got = world.states_for(3)
        for s in got[:1] + [world.state_for(2, 3)]:
            s['config']['weights'].append(9); s['config']['datasets'].append('x'); s['config']['strip_tokens'].append(5)
        assert got[1:] == want[1:] and world.states_for(3) == want


def test_every_document_once_after_lazy_rescales_through_units_of_no_shard(root):
    # 2 -> 13 x 2 (two workers of no logical shard) -> 3, reservoir windows, bestfit: each new unit loads the list of
    # every saved state itself (lazy); every token of every document of epoch 1 is delivered exactly once
    from test_streaming import assert_tiles
    tr, cov, st = TokenRoot(root), defaultdict(list), None
    kw = dict(KW, pack='bestfit', shuffle='reservoir')
    for j, (W, nw) in enumerate([(2, 1), (13, 2), (3, 1)]):
        units = [Unit(tr, r, W, w, nw, **kw) for r in range(W) for w in range(nw)]
        for u in units:
            if st is not None: u.load(st)
            try: deliver(u, tr, cov, [3, 2, None][j])
            except StopIteration: pass
        st = [u.state() for u in units]
        for u in units: u.close()
    assert_tiles(cov, tr, 1)
