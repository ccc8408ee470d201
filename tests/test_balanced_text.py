"""`PackedLoader(balanced=True)`: the split's row groups dealt over the ranks in turn (the reader's balanced plan), not
nanochat's striding file by file: every row group once per epoch across 7 and 12 ranks of a 3-file split (striding serves
at most 9), exact resume at odd points, the rescale of balanced states (3 -> 2, 2 -> 5, chains, random
chains) tiling epoch 1 exactly once, and the refusals of states whose plan is not the loader's."""
import json, re
from functools import partial

import pytest

from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.text.shards import row_group_plan
from nanochat_dl.pipe.packing import STRATEGIES
from toytext import toy_text_env
import elastictext
from elastictext import LAYOUT, check_tiling

KW = dict(elastictext.KW, balanced=True)


@pytest.fixture(scope='module')
def env(tmp_path_factory): return toy_text_env(tmp_path_factory.mktemp('balanced'), LAYOUT)


run_ranks, chain = partial(elastictext.run_ranks, KW), partial(elastictext.chain, KW)   # this file's settings


def test_the_plan_deals_row_groups_in_turn():
    "Rank r of W reads the split's r-th, (r+W)-th, ... non-empty row group: 7 ranks over 24 row groups read 3 or 4 each."
    plans = [row_group_plan(LAYOUT, r, 7, balanced=True) for r in range(7)]
    assert sorted(x for p in plans for x in p) == [(f, g) for f, n in enumerate(LAYOUT) for g in range(len(n))]
    assert [len(p) for p in plans] == [4, 4, 4, 3, 3, 3, 3]


@pytest.mark.parametrize('strategy', sorted(STRATEGIES))
@pytest.mark.parametrize('shuffle', [False, True])
def test_seven_ranks_read_every_row_group_once(env, strategy, shuffle):
    segs, states = run_ranks(env, 7, None, pack=strategy, shuffle=shuffle, seed=5)
    check_tiling(segs, env['lens'], strategy)
    assert all(s['config']['balanced'] is True and s['stages']['source']['cursor']['balanced'] for s in states)


def test_more_ranks_than_the_striding_serves(env):
    "Striding serves at most 9 ranks here (the most row groups a file has); the balanced plan serves 12, each row group once."
    with pytest.raises(ValueError, match=r"rank 9 of world_size 10 .* Use world_size <= 9"):
        run_ranks(env, 10, 1, balanced=False)
    segs, _ = run_ranks(env, 12, None)
    check_tiling(segs, env['lens'], 'bestfit-crop')


@pytest.mark.parametrize('strategy', ['bestfit-crop', 'bestfit-split', 'concat'])
def test_exact_resume_at_odd_points(env, strategy):
    "Rank 1 of 3, resumed from its state after batches 1, 3, 5, 8: the same batches and states as the run that went on."
    kw = dict(KW, pack=strategy, shuffle=True, seed=2, rank=1, world_size=3)
    with PackedLoader(env['tok'], files=env['files'], **kw) as ld: ref = [next(ld) for _ in range(14)]
    for k in (1, 3, 5, 8):
        with PackedLoader(env['tok'], files=env['files'], **kw, resume_state_dict=json.loads(json.dumps(ref[k - 1].state))) as ld:
            assert ld.resumed == 'exact'
            for want in ref[k:k + 5]:
                got = next(ld)
                assert got.inputs.equal(want.inputs) and got.state == want.state


@pytest.mark.parametrize('strategy', sorted(STRATEGIES))
@pytest.mark.parametrize('sizes', [(3, 2), (2, 5), (3, 5, 2), (7, 3), (1, 9, 4), (4, 4, 2)])
def test_rescale_tiles_epoch_once(env, strategy, sizes):
    segs = chain(env, sizes, [3] * len(sizes), pack=strategy)
    check_tiling(segs, env['lens'], strategy)


@elastictext.random_chains(20)
def test_random_rescale_chains_tile_epoch_once(env, sizes, ks, strategy, shuffle):
    segs = chain(env, sizes, ks, pack=strategy, shuffle=shuffle, seed=3)
    check_tiling(segs, env['lens'], strategy)


def test_a_rescaled_state_resumes_exactly(env):
    "A state saved while a rescaled rank catches up (its row groups listed) resumes exactly, at the same world size."
    _, old = run_ranks(env, 3, 2)
    kw = dict(KW, rank=1, world_size=5)
    with PackedLoader(env['tok'], files=env['files'], **kw, resume_state_dict=old) as ld: ref = [next(ld) for _ in range(6)]
    assert ref[0].state['stages']['source']['elastic']['groups']
    for k in (1, 2, 4):
        with PackedLoader(env['tok'], files=env['files'], **kw, resume_state_dict=json.loads(json.dumps(ref[k - 1].state))) as ld:
            for want in ref[k:]:
                got = next(ld)
                assert got.inputs.equal(want.inputs) and got.state == want.state


def test_mismatched_plans_are_refused(env):
    "A balanced state into a striding loader and back, alone or as a list, is refused naming `balanced`."
    _, bal = run_ranks(env, 2, 2)
    _, strided = run_ranks(env, 2, 2, balanced=False)
    for sd, mine in ((bal[0], False), (strided[0], True)):
        with pytest.raises(ValueError, match=rf"balanced={not mine!r}, but this loader has balanced={mine!r}"):
            PackedLoader(env['tok'], files=env['files'], **{**KW, 'balanced': mine}, rank=0, world_size=2, resume_state_dict=sd)
    for sts, mine in ((bal, False), (strided, True)):
        for W in (2, 3):
            with pytest.raises(ValueError, match=r"balanced="):
                PackedLoader(env['tok'], files=env['files'], **{**KW, 'balanced': mine}, rank=0, world_size=W, resume_state_dict=sts)
    with pytest.raises(ValueError, match=r"resume_state_dict mixes states of different runs: entry 1 has balanced"):
        PackedLoader(env['tok'], files=env['files'], **KW, rank=0, world_size=3, resume_state_dict=[bal[0], strided[1]])
    with pytest.raises(ValueError, match=r"balanced='yes' is invalid: expected True or False"):
        PackedLoader(env['tok'], files=env['files'], **{**KW, 'balanced': 'yes'}, rank=0, world_size=2)


def test_an_edited_catch_up_list_is_refused(env):
    "A rescaled state's row groups to catch up, edited (one not of this rank, two out of order), is refused naming the field."
    from nanochat_dl.text.state import state_checksum
    _, old = run_ranks(env, 3, 2)
    _, states = run_ranks(env, 2, 1, old)
    sd = states[0]
    groups = sd['stages']['source']['elastic']['groups']
    assert len(groups) >= 2
    field = re.escape("resume_state_dict['stages']['source']['elastic']['groups']")
    bad = json.loads(json.dumps(sd)); g = bad['stages']['source']['elastic']['groups']
    g[0], g[1] = g[1], g[0]; bad['checksum'] = state_checksum(bad)
    with pytest.raises(ValueError, match=field):
        PackedLoader(env['tok'], files=env['files'], **KW, rank=0, world_size=2, resume_state_dict=bad)
    other = states[1]['stages']['source']['elastic']['groups'] or states[1]['stages']['source']['elastic'].get('groups')
    bad = json.loads(json.dumps(sd)); bad['stages']['source']['elastic']['groups'].append(other[-1] if other else [1, 0, 0, 0])
    bad['checksum'] = state_checksum(bad)
    with pytest.raises(ValueError, match=field):
        PackedLoader(env['tok'], files=env['files'], **KW, rank=0, world_size=2, resume_state_dict=bad)


def test_default_config_names_no_plan(env):
    "The default (nanochat's striding): no `balanced` in the config, so earlier states and run ids are unchanged."
    _, states = run_ranks(env, 2, 1, balanced=False)
    assert 'balanced' not in states[0]['config']
