"""Resuming the nanochat text path (`PackedLoader`) at another world size, from the list of every rank's state: chains of
world sizes simulated in one process for every strategy, a property test over random chains and checkpoint steps, and
real processes (`torchrun --nproc_per_node 2`, gloo on the CPU) saving, restarting with 3, saving, restarting with 2.
In every case the segments all ranks placed, labelled with their epoch, tile each document of epoch 1 exactly once
(placed, or cropped where the strategy crops), and cover no token of epoch 2 twice."""
import json, os, re, shutil, subprocess, sys, textwrap
from functools import partial
from pathlib import Path

import pytest

from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.pipe.packing import STRATEGIES
from toytext import toy_text_env
import elastictext
from elastictext import LAYOUT, KW, check_tiling
from stateedit import DELETE, edited, paths   # a state's paths, and a copy with one field edited, as the single-state sweep uses them


@pytest.fixture(scope='module')
def env(tmp_path_factory): return toy_text_env(tmp_path_factory.mktemp('elastic'), LAYOUT)


run_ranks, chain = partial(elastictext.run_ranks, KW), partial(elastictext.chain, KW)   # this file's settings


@pytest.mark.parametrize('strategy', sorted(STRATEGIES))
@pytest.mark.parametrize('sizes', [(2, 3, 2), (3, 5, 2), (8, 1), (1, 4), (8, 3, 5), (1, 9, 7), (4, 4, 2)])
def test_chains_tile_epoch_once(env, strategy, sizes):
    segs = chain(env, sizes, [3] * len(sizes), pack=strategy)
    cropped = check_tiling(segs, env['lens'], strategy)
    if strategy == 'concat': assert cropped == 0                     # lossless: every token of epoch 1 placed exactly once
    if strategy == 'bestfit-pad':                                       # crops only documents longer than a row
        assert all(n + d > KW['seq_len'] + 1 for key, _, n, d in segs if d)


@elastictext.random_chains(25)
def test_random_chains_tile_epoch_once(env, sizes, ks, strategy, shuffle):
    segs = chain(env, sizes, ks, pack=strategy, shuffle=shuffle, seed=3)
    check_tiling(segs, env['lens'], strategy)


def test_same_world_size_list_is_exact(env):
    "A list at the same world size resumes each rank from its own state: the same batches and states as that state alone."
    _, states = run_ranks(env, 3, 4)
    for r in range(3):
        with PackedLoader(env['tok'], files=env['files'], **KW, rank=r, world_size=3, resume_state_dict=states[::-1]) as a, \
             PackedLoader(env['tok'], files=env['files'], **KW, rank=r, world_size=3, resume_state_dict=states[r]) as b:
            assert a.resumed == b.resumed == 'exact'
            for _ in range(6):
                x, y = next(a), next(b)
                assert x.inputs.equal(y.inputs) and x.state == y.state


WORKER = """
import json, sys
from pathlib import Path
import torch.distributed as dist
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.text.tokenizer import Tokenizer

dist.init_process_group('gloo')
rank, world = dist.get_rank(), dist.get_world_size()
tok_dir, files, k, src, dst = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
kw = json.loads(sys.argv[6])
states = None if src == '-' else [json.loads(p.read_text()) for p in sorted(Path(src).glob('state_*.json'))]

def epoch_done(sd):
    s = sd['stages']['source']
    return (s['cursor']['epoch'] > 1 and all(v[0] > 1 for v in s.get('elastic', {}).get('columns', []))
            and all(x > 1 for x in sd['stages']['pack']['buffer']['epoch']))

segs = []
with PackedLoader(Tokenizer.load(tok_dir), files=files, **kw, resume_state_dict=states) as ld:   # rank, world size: the process group
    assert (ld.config['rank'], ld.config['world_size']) == (rank, world), ld.config
    sd, n = ld.state_dict(), 0
    while (n < k) if k >= 0 else not epoch_done(sd):
        b = next(ld); n += 1; sd = b.state
        segs += [[*s.key, s.offset, s.length, s.dropped] for row in b.segments for s in row]
        assert n < 2000
    resumed = ld.resumed
dst.mkdir(exist_ok=True)
tmp = dst / f'.state_{rank}.json'
tmp.write_text(json.dumps(sd)); tmp.rename(dst / f'state_{rank}.json')   # one JSON per rank, written atomically
(dst / f'segs_{rank}.json').write_text(json.dumps(dict(resumed=resumed, segs=segs)))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize('strategy', ['bestfit-crop', 'bestfit-split'])
def test_torchrun_2_3_2(env, tmp_path, strategy):
    torchrun = shutil.which('torchrun') or str(Path(sys.executable).parent / 'torchrun')
    if not Path(torchrun).exists(): pytest.skip('torchrun is not installed')
    script = tmp_path / 'worker.py'
    script.write_text(textwrap.dedent(WORKER))
    kw = {**KW, 'pack': strategy}
    menv = dict(os.environ, OMP_NUM_THREADS='1')
    menv.pop('RANK', None); menv.pop('WORLD_SIZE', None)
    segs, src = [], '-'
    for i, (W, k) in enumerate([(2, 4), (3, 3), (2, -1)]):
        dst = tmp_path / f'phase{i}'
        r = subprocess.run([torchrun, '--standalone', '--nproc_per_node', str(W), str(script), str(env['tok_dir']),
                            json.dumps([str(f) for f in env['files']]), str(k), src, str(dst), json.dumps(kw)],
                           capture_output=True, text=True, env=menv, timeout=280)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
        assert sorted(p.name for p in dst.glob('state_*.json')) == [f'state_{j}.json' for j in range(W)]
        for j in range(W):
            got = json.loads((dst / f'segs_{j}.json').read_text())
            assert got['resumed'] == [None, 'rescaled', 'rescaled'][i]
            segs += [(tuple(s[:4]), *s[4:]) for s in got['segs']]
        src = str(dst)
    check_tiling(segs, env['lens'], strategy)


def test_one_state_at_another_size_says_to_pass_the_list(env):
    _, states = run_ranks(env, 2, 2)
    with pytest.raises(ValueError, match=r"world_size=2, but this loader has world_size=3: .*pass the list of every rank's state"):
        PackedLoader(env['tok'], files=env['files'], **KW, rank=0, world_size=3, resume_state_dict=states[0])


LIST_ERROR = re.compile(r"resume_state_dict(\[\d+\]| mixes | holds | lacks | is an empty)")


@pytest.mark.timeout(240)
def test_every_field_of_a_list_edited_is_refused_naming_the_state(env):
    """Every field (and list item) of one rank's state in a list of two, and the same edit in both states, replaced by values
    of other kinds or deleted, loaded at another world size (3) and at the same (2, by rank 1, whose own state may be the
    good one): refused with a ValueError or TypeError whose message starts with the entry of `resume_state_dict` at fault
    (`resume_state_dict[i]`, or which entries mix, repeat or lack a rank): no other exception, no hang, no edit accepted
    (only the old run's `B` and `buffer_size`, which a rescaled run may change, can be any int >= 1; a state without
    `max_wait` is one saved before it was a setting, read as the default)."""
    _, states = run_ranks(env, 2, 3)
    wrong, accepted = [], []
    for path in paths(states[0])[1:]:
        for v in (None, 0, -1, True, 1.5, 'x', [], {}, [None], 2 ** 40, DELETE):
            for which in ([0], [0, 1]):
                bad = [(i in which and edited(s, path, v)) or json.loads(json.dumps(s)) for i, s in enumerate(states)]
                if json.dumps(bad) == json.dumps(states): continue
                for W in (3, 2):
                    try: PackedLoader(env['tok'], files=env['files'], **KW, rank=1, world_size=W, resume_state_dict=bad).close()
                    except (ValueError, TypeError) as e:
                        if not LIST_ERROR.match(str(e)): wrong.append((path, v, which, W, repr(e)[:300]))
                    except Exception as e: wrong.append((path, v, which, W, repr(e)[:300]))
                    else:
                        if path == ('config', 'max_wait') and v is DELETE: continue   # an older state's form: the default
                        if not (W == 3 and which == [0, 1] and path in (('config', 'B'), ('config', 'buffer_size')) and v == 2 ** 40):
                            accepted.append((path, v, which, W))
    assert not wrong, wrong[:6]
    assert not accepted, accepted[:6]


def test_a_rescaled_state_lacking_a_column_is_refused(env):
    """A state saved while columns catch up lists every column of its rank; one lacking a column (its checksum made anew, as
    a hand edit would) is refused naming the field, at another world size and at the same, rather than failing inside the
    rescale (KeyError) or losing that column's documents."""
    from nanochat_dl.text.state import state_checksum as _checksum
    _, states = run_ranks(env, 3, 1, run_ranks(env, 2, 3)[1])
    assert states[0]['stages']['source']['elastic']['columns']
    del states[0]['stages']['source']['elastic']['columns'][0]
    states[0]['checksum'] = _checksum(states[0])
    msg = r"resume_state_dict\['stages'\]\['source'\]\['elastic'\]\['columns'\] lacks column 0 of rank 0 of 3"
    for W, sd in ((2, states), (3, states), (3, states[0])):
        with pytest.raises(ValueError, match=(r"resume_state_dict\[0\] \(rank 0 of 3\): " if sd is states else '') + msg):
            PackedLoader(env['tok'], files=env['files'], **KW, rank=0, world_size=W, resume_state_dict=sd)
