"""Shared by the lazy rescale's tests (`World(lazy=True)`): every unit's state of a world after some batches, and the
check that the full expansion and every lazy rank refuse a list of states, naming the entry at fault."""
from collections import defaultdict

import pytest

from nanochat_dl.tokens import World, owned_shards
from test_elastic import Unit, deliver


def saved_units(tr, W, nw, n, **kw):
    """Every unit's state (one per unit, flat, rank by rank) of `W` ranks of `nw` workers after `n` batches each (`n` a
    function of the unit's index: its own number), with the config and fingerprint; a unit of no logical shard: none."""
    units = [Unit(tr, r, W, w, nw, **kw) for r in range(W) for w in range(nw)]
    cfg = units[0].ld.config if units[0].ld else units[0].ds.config
    fp = units[0].ld.fingerprint if units[0].ld else units[0].ds.fingerprint
    for k, u in enumerate(units):
        try: deliver(u, tr, defaultdict(list), n(k) if callable(n) else n)
        except StopIteration:                          # a worker of no logical shard has nothing to deliver
            if len(owned_shards(cfg['n_logical_shards'], k // nw, W, k % nw, nw)): raise
    states = [u.state() for u in units]
    for u in units: u.close()
    return states, cfg, fp


def assert_refused_by_every_rank(states, tr, cfg, fp, j, W=3):
    "The full expansion (`lazy=False`) and each of `W` lazy ranks refuse `states` at `W` ranks, naming `states[j]`."
    with pytest.raises(ValueError, match=rf"states\[{j}\]"): World(states, tr, cfg, fp, lazy=False).states_for(W)
    for r in range(W):
        with pytest.raises(ValueError, match=rf"states\[{j}\]"): World(states, tr, cfg, fp).state_for(r, W)
