"""The drop-in inside nanochat's own training script: it reads the shards nanochat's `list_parquet_files()` reads, and
the state it hands out with a batch resumes *at* that batch, which is what nanochat's loop saves (the state of the batch
fetched but not yet trained on). Under torchrun, where nanochat saves rank 0's state only and every rank loads it, a
foreign rank's state resumes as nanochat's loader would, with one warning; the list of every rank's states resumes
exactly."""
import itertools, json, os, re, shutil, subprocess, sys, textwrap, warnings
from pathlib import Path

import pytest
import torch

from nanochat_dl.dataloader import (tokenizing_distributed_data_loader_with_state_bos_bestfit as dropin,
                                    tokenizing_distributed_data_loader_bos_bestfit as dropin_pairs)
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.text.stages import reference_loader
from nanochat_dl.testing import write_toy_shards
from toytext import toy_text_env, words


def other(f, g, r): return ' '.join([f"z{r}{g}{f}q"] * (2 + (5 * f + 7 * g + 3 * r) % 19))

LAYOUT = [[5, 3, 4, 2], [2, 6, 1, 3], [4, 4, 5], [3, 3, 3, 2], [2, 2]]
KW = dict(tokenizer_threads=1, tokenizer_batch_size=2, device='cpu', buffer_size=6)   # many row groups, several epochs
PKW = {('pack_buffer' if k == 'buffer_size' else k): v for k, v in KW.items()}   # the same, in PackedLoader's names


@pytest.fixture(scope='module')
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp('dropin')
    e = toy_text_env(d, LAYOUT)   # the sample shards in base_data/, a tokenizer trained on them, toy shards in toy/
    return dict(e, sample=d / 'base_data', toy=d / 'toy')


@pytest.fixture
def clean_env(monkeypatch):
    for k in ('NANOCHAT_DL_DATA_DIR', 'NANOCHAT_DL_BASE_DIR', 'NANOCHAT_BASE_DIR', 'XDG_CACHE_HOME',
              'RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


# --- 1. which folder ------------------------------------------------------------------------------------------------

def _home(tmp_path, env, mp):
    "A home as a user has it after `nanochat-dl demo`: our default folder holds the sample shards."
    home = tmp_path / 'home'
    shutil.copytree(env['sample'], home / '.cache' / 'nanochat_dl' / 'base_data')
    mp.setenv('HOME', str(home))
    return home


def _folder_read(tok, capfd, **kw):
    "The folder the drop-in reads, its first batch, and what it printed."
    capfd.readouterr()
    with dropin(tok, 2, 32, 'train', **KW, **kw) as dl:
        folders = {p.parent for p in dl.loader.files}
        x, y, _ = next(dl)
    out = capfd.readouterr()
    assert len(folders) == 1
    return folders.pop(), x, (out.out + out.err).splitlines()


@pytest.mark.parametrize('where', ['NANOCHAT_BASE_DIR', 'home'])
@pytest.mark.parametrize('layout', ['climbmix', 'legacy', 'both'])
def test_dropin_reads_nanochats_folder(env, tmp_path, clean_env, capfd, where, layout):
    """With no data_dir= and no NANOCHAT_DL_* setting, the drop-in reads the folder nanochat's `list_parquet_files()`
    reads ($NANOCHAT_BASE_DIR, else ~/.cache/nanochat; base_data_climbmix if it exists, else base_data), not our default
    folder, even when that one holds shards (as after `nanochat-dl demo`); it prints one line naming the folder."""
    home = _home(tmp_path, env, clean_env)
    base = home / '.cache' / 'nanochat'
    if where == 'NANOCHAT_BASE_DIR':
        base = tmp_path / 'nanochat_base'
        clean_env.setenv('NANOCHAT_BASE_DIR', str(base))
    if layout in ('climbmix', 'both'): write_toy_shards(base / 'base_data_climbmix', LAYOUT, text_fn=words)
    if layout in ('legacy', 'both'): write_toy_shards(base / 'base_data', LAYOUT[:3], text_fn=other)
    want = base / ('base_data' if layout == 'legacy' else 'base_data_climbmix')
    folder, x, lines = _folder_read(env['tok'], capfd)
    assert folder == want
    assert len(lines) == 1 and str(want) in lines[0], lines
    ref = reference_loader(env['tok'], 2, 32, files=sorted(want.glob('*.parquet'))[:-1], tokenizer_threads=1,
                           tokenizer_batch_size=2, buffer_size=6)
    assert torch.equal(x, next(ref)[0])
    with PackedLoader(env['tok'], 2, 32, device='cpu', tokenizer_threads=1) as ld:   # PackedLoader's default stays ours
        assert {p.parent for p in ld.files} == {home / '.cache' / 'nanochat_dl' / 'base_data'}


def test_dropin_settings_win_over_nanochats_folder(env, tmp_path, clean_env, capfd):
    "NANOCHAT_DL_DATA_DIR, NANOCHAT_DL_BASE_DIR and data_dir= each say otherwise; a missing nanochat folder is named."
    home = _home(tmp_path, env, clean_env)
    write_toy_shards(home / '.cache' / 'nanochat' / 'base_data_climbmix', LAYOUT, text_fn=words)
    assert _folder_read(env['tok'], capfd, data_dir=env['toy'])[0] == env['toy']
    clean_env.setenv('NANOCHAT_DL_BASE_DIR', str(home / '.cache' / 'nanochat_dl'))
    folder, _, lines = _folder_read(env['tok'], capfd)
    assert folder == home / '.cache' / 'nanochat_dl' / 'base_data' and len(lines) == 1 and str(folder) in lines[0]
    clean_env.setenv('NANOCHAT_DL_DATA_DIR', str(env['toy']))
    assert _folder_read(env['tok'], capfd)[0] == env['toy']
    clean_env.delenv('NANOCHAT_DL_DATA_DIR'); clean_env.delenv('NANOCHAT_DL_BASE_DIR')
    clean_env.setenv('NANOCHAT_BASE_DIR', str(tmp_path / 'empty'))
    with pytest.raises(FileNotFoundError) as e: dropin_pairs(env['tok'], 2, 32, 'train', **KW)
    for name in ('base_data_climbmix', 'base_data'): assert str(tmp_path / 'empty' / name) in str(e.value)


# --- 2. nanochat's loop ---------------------------------------------------------------------------------------------

def nanochat_loop(tok, steps, save_every, resume_from_step=-1, resume_state=None, grad_accum_steps=1, B=2, T=32, **kw):
    """scripts/base_train.py's loop, shape for shape: the first batch fetched before the loop; at the top of step k a
    checkpoint saves the state that came with the batch fetched but not yet trained on (never at step 0 or at the resume
    step, always at the last); each micro-step trains on x, y, then fetches the next x, y, state."""
    train_loader = dropin(tok, B, T, split='train', resume_state_dict=resume_state, **{**KW, **kw})
    x, y, dataloader_state_dict = next(train_loader)     # kick off load of the very first batch of data
    step = 0 if resume_from_step == -1 else resume_from_step
    trained, checkpoints = {}, {}
    while True:
        last_step = step == steps
        if last_step or (step > 0 and step != resume_from_step and save_every > 0 and step % save_every == 0):
            checkpoints[step] = json.loads(json.dumps({'step': step, 'dataloader_state_dict': dataloader_state_dict}))
        if last_step: break
        trained[step] = []
        for micro_step in range(grad_accum_steps):
            trained[step].append((x.clone(), y.clone()))   # loss = model(x, y); loss.backward()
            x, y, dataloader_state_dict = next(train_loader)   # prefetch the next batch while the GPU is busy
        step += 1
    train_loader.close()
    return trained, checkpoints


def _same(a, b):
    "Two runs' trained batches, step by step, bit for bit."
    return a.keys() == b.keys() and all(torch.equal(x, x0) and torch.equal(y, y0)
                                        for k in a for (x, y), (x0, y0) in zip(a[k], b[k]))


@pytest.mark.parametrize('grad_accum_steps,B,T,buffer_size', [(1, 2, 32, 6), (2, 3, 24, 1), (1, 1, 64, 20)])
def test_nanochats_loop_resumes_bit_for_bit(env, clean_env, grad_accum_steps, B, T, buffer_size):
    """Resumed from any checkpoint nanochat's loop saved, the loop trains on exactly the batches the uninterrupted run
    trained on, bit for bit (across epochs), and saves the same checkpoints; resumed twice, too."""
    kw = dict(data_dir=env['toy'], grad_accum_steps=grad_accum_steps, B=B, T=T, buffer_size=buffer_size)
    steps = 24
    full, ckpts = nanochat_loop(env['tok'], steps, 3, **kw)
    assert max(s['dataloader_state_dict']['epoch'] for s in ckpts.values()) >= 2
    again = {}
    for k in (3, 12, 21):
        got, again[k] = nanochat_loop(env['tok'], steps, 3, k, ckpts[k]['dataloader_state_dict'], **kw)
        assert _same(got, {s: full[s] for s in range(k, steps)}), f"resumed at step {k}"
        assert again[k] == {s: c for s, c in ckpts.items() if s > k}
    got, _ = nanochat_loop(env['tok'], steps, 3, 15, again[12][15]['dataloader_state_dict'], **kw)  # resumed twice
    assert _same(got, {s: full[s] for s in range(15, steps)})


def test_dropin_state_keeps_nanochats_fields(env, clean_env):
    "The state's pq_idx, rg_idx and epoch are nanochat's for its batch (its log line reads them); it stays small."
    ref = reference_loader(env['tok'], 2, 32, files=sorted(env['toy'].glob('*.parquet'))[:-1], tokenizer_threads=1,
                           tokenizer_batch_size=2, buffer_size=6)
    with dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], **KW) as dl:
        for _ in range(30):
            (_, _, s), (_, _, s0) = next(dl), next(ref)
            assert {k: s[k] for k in s0} == s0
            assert len(json.dumps(s)) < 8192


def test_dropin_resumes_from_older_states(env, clean_env):
    """nanochat's {pq_idx, rg_idx, epoch} resumes as nanochat's loader does; a state of `PackedLoader` (what the drop-in
    handed out before it resumed at its batch) resumes after its batch, as it always did, with a warning saying so."""
    with dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], **KW) as dl:
        full = [(x.clone(), y.clone(), s) for x, y, s in itertools.islice(dl, 12)]   # (the drop-in's tensors are views)
    nc = {k: full[5][2][k] for k in ('pq_idx', 'rg_idx', 'epoch')}
    with PackedLoader(env['tok'], 2, 32, 'train', env['toy'], resume_state_dict=nc, **PKW) as ld:
        want = next(ld).inputs.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], resume_state_dict=nc, **KW) as dl:
            assert torch.equal(next(dl)[0], want) and dl.loader.resumed == 'approximate'
    assert not [w for w in caught if 'resume' in str(w.message)]
    with PackedLoader(env['tok'], 2, 32, 'train', env['toy'], **PKW) as ld:
        old = [b.state for b in itertools.islice(ld, 6)][-1]
    with pytest.warns(UserWarning, match='after its batch'):
        dl = dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], resume_state_dict=json.loads(json.dumps(old)),
                    **KW)
    with dl: assert [torch.equal(next(dl)[0], b[0]) for b in full[6:9]] == [True] * 3


# --- 3. another rank's state ----------------------------------------------------------------------------------------

def _as_rank(mp, r, W): mp.setenv('RANK', str(r)); mp.setenv('WORLD_SIZE', str(W)); mp.setenv('LOCAL_RANK', str(r))


def test_another_ranks_state_resumes_as_nanochat_would(env, clean_env):
    """Rank 1 given rank 0's state (nanochat's script saves only rank 0's) resumes where nanochat's loader would on
    rank 1 (the row group after rank 0's, in rank 1's stride), warning once; given every rank's states, it resumes
    exactly."""
    runs, ckpts = {}, {}
    for r in (0, 1):
        _as_rank(clean_env, r, 2)
        runs[r], ckpts[r] = nanochat_loop(env['tok'], 12, 4, data_dir=env['toy'])
    s0 = ckpts[0][8]['dataloader_state_dict']
    nc = {k: s0[k] for k in ('pq_idx', 'rg_idx', 'epoch')}
    with PackedLoader(env['tok'], 2, 32, 'train', env['toy'], rank=1, world_size=2, resume_state_dict=nc, **PKW) as ld:
        want = [(b.inputs.clone(), b.targets.clone()) for b in itertools.islice(ld, 4)]
    _as_rank(clean_env, 1, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        got, _ = nanochat_loop(env['tok'], 12, 4, 8, s0, data_dir=env['toy'])
    mine = [w for w in caught if 'every rank' in str(w.message)]
    assert len(mine) == 1 and 'rank 0 of 2' in str(mine[0].message), [str(w.message) for w in caught]
    assert _same(got, {8 + i: [b] for i, b in enumerate(want)})
    both = [ckpts[r][8]['dataloader_state_dict'] for r in (0, 1)]
    for r in (0, 1):
        _as_rank(clean_env, r, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            got, _ = nanochat_loop(env['tok'], 12, 4, 8, both, data_dir=env['toy'])
        assert not caught, [str(w.message) for w in caught]
        assert _same(got, {s: runs[r][s] for s in range(8, 12)}), f"rank {r}"


WORKER = """
import json, os, sys, warnings
import torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from test_dropin import nanochat_loop, KW, PKW
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.text.tokenizer import Tokenizer

dist.init_process_group('gloo')
rank, world = dist.get_rank(), dist.get_world_size()
tok, out = Tokenizer.load(sys.argv[1]), sys.argv[2]
steps, k = 12, 6
full, ckpts = nanochat_loop(tok, steps, k)
everyone = [None] * world                                   # the README's lines: every rank's state, gathered
dist.all_gather_object(everyone, ckpts[k]['dataloader_state_dict'])
if rank == 0:                                               # nanochat's save_checkpoint: rank 0 writes the metadata
    with open(f'{out}/meta_{k:06d}.json', 'w') as f: json.dump(ckpts[k], f)
    with open(f'{out}/meta_all_{k:06d}.json', 'w') as f: json.dump(dict(ckpts[k], dataloader_state_dict=everyone), f)
dist.barrier()
res = {}
for name in ('meta', 'meta_all'):                           # every rank loads rank 0's file, as nanochat's script does
    with open(f'{out}/{name}_{k:06d}.json') as f: meta = json.load(f)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        got, _ = nanochat_loop(tok, steps, k, k, meta['dataloader_state_dict'])
    exact = all(all((a == b).all().item() for (a, _), (b, _) in zip(got[s], full[s])) for s in range(k, steps))
    res[name] = dict(exact=exact, warnings=[str(w.message) for w in caught])
    if name == 'meta':
        s0 = meta['dataloader_state_dict']
        nc = {key: s0[key] for key in ('pq_idx', 'rg_idx', 'epoch')}
        with PackedLoader(tok, 2, 32, 'train', resume_state_dict=nc, **PKW) as ld:   # nanochat's resume on this rank
            start = ld.reader.state_dict()
            want = [next(ld).inputs.clone() for _ in range(steps - k)]
        res[name].update(nanochat=all((got[k + i][0][0] == w).all().item() for i, w in enumerate(want)), nc=nc,
                         start=[start['file'], start['rg']])
gathered = [None] * world
dist.all_gather_object(gathered, res)
if rank == 0: print('RESULT ' + json.dumps(gathered), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(300)
def test_torchrun_ranks_load_rank0s_checkpoint(env, tmp_path):
    """torchrun, 2 ranks (gloo, CPU), nanochat's loop: with rank 0's checkpoint loaded by both ranks, nothing stops;
    rank 0 resumes exactly, rank 1 where nanochat's loader would, with one warning; with every rank's state saved, both
    exactly."""
    torchrun = shutil.which('torchrun') or str(Path(sys.executable).parent / 'torchrun')
    if not Path(torchrun).exists(): pytest.skip('torchrun is not installed')
    script = tmp_path / 'worker.py'
    script.write_text(textwrap.dedent(WORKER))
    run_env = {k: v for k, v in os.environ.items() if not k.startswith('NANOCHAT')}
    run_env.update(NANOCHAT_DL_DATA_DIR=str(env['toy']), OMP_NUM_THREADS='1')
    r = subprocess.run([torchrun, '--standalone', '--nproc_per_node', '2', str(script), str(env['tok_dir']),
                        str(tmp_path), str(Path(__file__).parent)],
                       capture_output=True, text=True, env=run_env, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    line = [l for l in r.stdout.splitlines() if l.startswith('RESULT ')]
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(line[-1][7:])
    r0, r1 = res[0]['meta'], res[1]['meta']
    assert r0['exact'] and not r0['warnings']                           # rank 0's own state: exact, silent
    assert len(r1['warnings']) == 1 and 'every rank' in r1['warnings'][0]   # rank 1: one warning
    assert r1['nanochat']                                                 # and nanochat's resume for rank 1
    n_rg = [len(g) for g in LAYOUT[:-1]]
    nc = r1['nc']
    g = (nc['rg_idx'] // 2 + 1) * 2 + 1                 # nanochat's rule: the next row group in rank 1's stride
    assert r1['start'] == ([nc['pq_idx'], g] if g < n_rg[nc['pq_idx']] else [nc['pq_idx'] + 1, 1])
    for r in (0, 1): assert res[r]['meta_all'] == dict(exact=True, warnings=[])


# --- 4. the adversary's round: hand-edited states, odd folders ------------------------------------------------------

def test_a_hand_edited_at_batch_is_named(env, clean_env, tmp_path):
    """A state whose 'at_batch' was edited by hand (wrong type, fields missing or changed, another loader's state, a
    state of other data or another tokenizer) is refused with an error that names resume_state_dict['at_batch'] and
    what was expected; a list there is not taken for every rank's states."""
    from nanochat_dl.tokens import StreamingLoader
    from nanochat_dl.tokens.files import write_token_file
    with dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], **KW) as dl:
        s = json.loads(json.dumps([next(dl) for _ in range(4)][-1][2]))
    at = s['at_batch']
    write_token_file(tmp_path / 'root' / 'web' / '0.arrow', [list(range(5, 30))] * 4)
    with StreamingLoader(tmp_path / 'root', 8, 1, n_logical_shards=2) as sl: stream_state = sl.state_dict()
    def edit(f):
        a = json.loads(json.dumps(at)); f(a); return a
    cases = {'a str': ('junk', "got str 'junk'"), 'a list': ([at, at], 'got list'), 'an int': (3, 'got int 3'),
             'None': (None, 'got NoneType'), 'an empty dict': ({}, "lacks 'format'"),
             'no config': (edit(lambda a: a.pop('config')), r"lacks \['config'\]"),
             'no stages': (edit(lambda a: a.pop('stages')), r"lacks \['stages'\]"),
             'no pq_idx': (edit(lambda a: a.pop('pq_idx')), "not 'pq_idx'"),
             'another B': (edit(lambda a: a['config'].update(B=3)), 'B=3'),
             "StreamingLoader's state": (stream_state, 'nanochat_dl.streaming')}
    for what, (v, expected) in cases.items():
        with pytest.raises((TypeError, ValueError), match=r"^resume_state_dict\['at_batch'\]") as e:
            dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], resume_state_dict=dict(s, at_batch=v), **KW)
        assert re.search(expected, str(e.value)), (what, str(e.value))
        assert re.search('expected|needs|reads|has the three', str(e.value)), (what, str(e.value))   # and what it wants
    other = write_toy_shards(tmp_path / 'other', LAYOUT[:3], text_fn=other_text)
    for what, kw in (('other data', dict(data_dir=other[0].parent)),):
        with pytest.raises(ValueError, match=r"^resume_state_dict\['at_batch'\]\['fingerprint'\]: saved over different data"):
            dropin(env['tok'], 2, 32, 'train', resume_state_dict=s, **{**dict(data_dir=env['toy']), **kw}, **KW)
    from nanochat_dl.text.tokenizer import Tokenizer
    tok2 = Tokenizer.train_from_iterator([words(f, g, r) + ' y' for f in range(5) for g in range(4) for r in range(6)], 280)
    with pytest.raises(ValueError, match=r"^resume_state_dict\['at_batch'\]\['fingerprint'\]: saved with a different tokenizer"):
        dropin(tok2, 2, 32, 'train', data_dir=env['toy'], resume_state_dict=s, **KW)
    with pytest.raises(TypeError, match=r"^resume_state_dict\[1\]\['at_batch'\] must be a dict"):   # in a list, too
        dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], resume_state_dict=[s, dict(s, at_batch='x')], **KW)


def other_text(f, g, r): return other(f, g, r) + ' q'


def test_odd_nanochat_folders_are_named(env, tmp_path, clean_env, capfd):
    """$NANOCHAT_BASE_DIR set to a file, to a folder whose base_data_climbmix is a file, or to a path with '~' (which
    nanochat does not expand): the error says which and what is expected; '' means unset, as for nanochat; the line
    printed names the folder actually read, once."""
    clean_env.setenv('HOME', str(tmp_path / 'home'))
    (tmp_path / 'afile').write_text('x')
    clean_env.setenv('NANOCHAT_BASE_DIR', str(tmp_path / 'afile'))
    with pytest.raises(FileNotFoundError, match=r"NANOCHAT_BASE_DIR=.*afile.* is a file"): dropin(env['tok'], 2, 32, 'train', **KW)
    (tmp_path / 'cm' / 'base_data').mkdir(parents=True); (tmp_path / 'cm' / 'base_data_climbmix').write_text('x')
    clean_env.setenv('NANOCHAT_BASE_DIR', str(tmp_path / 'cm'))
    with pytest.raises(FileNotFoundError, match=r"base_data_climbmix is a file") as e: dropin(env['tok'], 2, 32, 'train', **KW)
    assert 'neither' not in str(e.value)                   # base_data is a folder: nanochat reads the file, and fails
    clean_env.setenv('NANOCHAT_BASE_DIR', '~/nc')
    with pytest.raises(FileNotFoundError, match=r"nanochat does not expand '~'"): dropin(env['tok'], 2, 32, 'train', **KW)
    clean_env.setenv('NANOCHAT_BASE_DIR', '')
    write_toy_shards(tmp_path / 'home' / '.cache' / 'nanochat' / 'base_data', LAYOUT, text_fn=words)
    assert _folder_read(env['tok'], capfd)[0] == tmp_path / 'home' / '.cache' / 'nanochat' / 'base_data'
    shutil.copytree(env['toy'], tmp_path / 'home' / 'mine')
    clean_env.setenv('NANOCHAT_DL_DATA_DIR', '~/mine')
    folder, _, lines = _folder_read(env['tok'], capfd)
    assert folder == tmp_path / 'home' / 'mine' and len(lines) == 1 and str(folder) in lines[0], lines
    assert _folder_read(env['tok'], capfd)[2] == []        # once per folder


def test_threads_get_each_batch_with_its_own_state(env, clean_env, monkeypatch):
    """`next()` on the drop-in from three threads: each batch comes with the state that resumes at it (the loader's
    state before that batch), whichever thread gets there first."""
    import threading, time
    real, seen = PackedLoader.__next__, threading.local()
    def late(self):                                    # a thread that got its batch is overtaken before it pairs its state
        b = real(self)
        seen.step = b.metrics['step']
        time.sleep(0.002 * (threading.get_ident() % 3))
        return b
    monkeypatch.setattr(PackedLoader, '__next__', late)
    wrong = []
    with dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], **KW) as dl:
        def work():
            for _ in range(15):
                _, _, s = next(dl)
                if s['at_batch']['stages']['batch']['step'] != seen.step - 1: wrong.append(seen.step)
        ts = [threading.Thread(target=work) for _ in range(3)]
        for t in ts: t.start()
        for t in ts: t.join(60)
    assert wrong == []


def test_a_folder_is_named_once_however_it_is_given(env, tmp_path, clean_env, capfd):
    "The same folder given by data_dir= (with a trailing slash, or relative) and by NANOCHAT_DL_DATA_DIR: one line."
    shutil.copytree(env['toy'], tmp_path / 'once')
    lines = _folder_read(env['tok'], capfd, data_dir=str(tmp_path / 'once') + '/')[2]
    assert len(lines) == 1 and str(tmp_path / 'once') in lines[0], lines
    clean_env.setenv('NANOCHAT_DL_DATA_DIR', str(tmp_path / 'once'))
    assert _folder_read(env['tok'], capfd)[2] == []
    clean_env.chdir(tmp_path)
    assert _folder_read(env['tok'], capfd, data_dir='once')[2] == []


def test_edits_of_the_dropins_views_and_states_corrupt_nothing(env, clean_env):
    """The drop-in's x, y are nanochat's reused views (a later batch is written into them), but editing them in place
    (add_, zero_, resize_) or editing a state it handed out changes no later batch, no later state, no resume."""
    def scrub(o):
        for k, v in list(o.items() if isinstance(o, dict) else enumerate(o)):
            if isinstance(v, (dict, list)): scrub(v)
            else: o[k] = -7
    with dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], **KW) as dl:
        ref = [(x.clone(), json.dumps(s)) for x, _, s in itertools.islice(dl, 10)]
    with dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], **KW) as dl:
        for i in range(10):
            x, y, s = next(dl)
            assert torch.equal(x, ref[i][0]) and json.dumps(s) == ref[i][1], f"batch {i}"
            x.add_(1); y.zero_(); x.resize_(1); scrub(s)
    with dropin(env['tok'], 2, 32, 'train', data_dir=env['toy'], resume_state_dict=json.loads(ref[4][1]), **KW) as dl:
        assert [torch.equal(next(dl)[0], x) for x, _ in ref[4:8]] == [True] * 4


# --- 4. one rule for the device ---------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason='the rule for a machine without CUDA')
def test_an_explicit_cuda_without_cuda_is_refused_as_the_loaders_refuse_it(env, clean_env):
    # issue 19: the drop-in warned and used the CPU, PackedLoader/StreamingLoader/demo raised; now 'auto' falls back, 'cuda' refuses
    kw = dict(KW, data_dir=env['toy'])
    for dev in ('cuda', 'cuda:0', torch.device('cuda')):
        with pytest.raises(RuntimeError, match='CUDA is not available on this machine') as e: dropin(env['tok'], 2, 32, 'train', **dict(kw, device=dev))
        with pytest.raises(RuntimeError) as p: PackedLoader(env['tok'], 2, 32, 'train', env['toy'], device=dev, tokenizer_threads=1)
        assert str(e.value) == str(p.value)
    with dropin(env['tok'], 2, 32, 'train', **dict(kw, device='auto')) as dl: assert next(dl)[0].device.type == 'cpu'
