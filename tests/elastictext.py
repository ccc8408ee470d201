"""Chains of world sizes for the text loader's rescale tests (`PackedLoader`, striding or balanced): ranks run one after
another in one process, each for `k` batches or until its epoch 1 is done, and the check that epoch 1 is tiled exactly
once."""
import json

from hypothesis import HealthCheck, given, settings, strategies as st
from nanochat_dl.pipe.packing import STRATEGIES
from nanochat_dl.text.loader import PackedLoader

LAYOUT = [[3, 2, 4, 1, 3, 2, 2, 3], [2, 3, 1, 4, 2, 3, 3], [4, 1, 2, 3, 2, 1, 3, 2, 2]]   # 9 columns: up to 9 ranks
KW = dict(batch_size=2, seq_len=32, pack_buffer=6, tokenizer_batch_size=2, device='cpu', tokenizer_threads=1,
          tokenize_in='threads', prefetch=0)


def epoch_done(sd, e=1):
    "Whether a rank's state has nothing of epoch `e` left: cursor past it, nothing of it to catch up, none buffered."
    src = sd['stages']['source']
    el = src.get('elastic', {})
    return (src['cursor']['epoch'] > e and all(v[0] > e for v in el.get('columns', []) + el.get('groups', []))
            and all(x > e for x in sd['stages']['pack']['buffer']['epoch']))


def run_ranks(base, env, W, k, states=None, **kw):
    """Ranks 0..W-1 (settings `base | kw`, from the list `states`), `k` batches each (None: until epoch 1 is done):
    their segments `(key, offset, length, dropped)`, last states."""
    segs, out = [], []
    for r in range(W):
        with PackedLoader(env['tok'], files=env['files'], **{**base, **kw}, rank=r, world_size=W,
                          resume_state_dict=states) as ld:
            assert ld.resumed == (None if states is None else 'exact' if len(states) == W else 'rescaled')
            sd, n = ld.state_dict(), 0
            while (n < k) if k is not None else not epoch_done(sd):
                b = next(ld); n += 1; sd = b.state
                segs += [(tuple(s.key), s.offset, s.length, s.dropped) for row in b.segments for s in row]
                assert n < 2000, "epoch 1 never finished"
        out.append(json.loads(json.dumps(sd)))
    return segs, out


def chain(base, env, sizes, ks, **kw):
    "World sizes `sizes` in turn, each resumed from the states the one before saved after `ks[i]` batches: segments."
    segs, states = [], None
    for i, W in enumerate(sizes):
        s, states = run_ranks(base, env, W, ks[i] if i < len(sizes) - 1 else None, states, **kw)
        segs += s
    return segs


def check_tiling(segs, lens, strategy):
    """Epoch 1: the ranges of every document placed or cropped tile it exactly once; epoch 2: no token twice.
    Returns the tokens cropped in epoch 1."""
    cover = {1: {}, 2: {}}
    for key, off, n, dropped in segs:
        if key[0] in cover:
            end = off + n + dropped - (strategy == 'bestfit-split' and off > 0)
            cover[key[0]].setdefault(key[1:], []).append((off, end))
    assert set(cover[1]) == set(lens), f"documents of epoch 1 never delivered: {sorted(set(lens) - set(cover[1]))[:5]}"
    for a, rs in cover[1].items():
        rs.sort()
        assert rs[0][0] == 0 and rs[-1][1] == lens[a] and all(x[1] == y[0] for x, y in zip(rs, rs[1:])), \
            (a, rs, lens[a])
    for a, rs in cover[2].items():
        rs.sort()
        assert all(x[1] <= y[0] for x, y in zip(rs, rs[1:])), (a, rs)
    return sum(d for key, _, _, d in segs if key[0] == 1)


def random_chains(n:int):
    "A test of `(env, sizes, ks, strategy, shuffle)` run on `n` random chains of 2 to 4 world sizes (hypothesis)."
    return lambda f: settings(max_examples=n, deadline=None, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.too_slow])(given(
        sizes=st.lists(st.integers(1, 9), min_size=2, max_size=4), ks=st.lists(st.integers(0, 12), min_size=4,
        max_size=4), strategy=st.sampled_from(sorted(STRATEGIES)), shuffle=st.booleans())(f))
