"""`nanochat-dl tokenize` as a command and as a cluster job: exit codes and messages, two ranks as two real processes
(with `--rank/--world-size`, and under `torchrun` with and without a gloo process group), rank 0 giving up, worker
processes that cannot import from the current folder, and a worker killed in the middle of a shard."""
import hashlib, json, os, shutil, signal, subprocess, sys, textwrap, time
from pathlib import Path

import pyarrow as pa, pyarrow.parquet as pq
import pytest

from nanochat_dl.tokens import TokenRoot, run_tasks, read_manifest, tokenize
from nanochat_dl.cli import main
from nanochat_dl.text.sample import make_sample_shards
from nanochat_dl.text.tokenizer import Tokenizer, train_tokenizer

BIN = Path(sys.executable).parent
CLI = shutil.which('nanochat-dl') or str(BIN / 'nanochat-dl')
TORCHRUN = shutil.which('torchrun') or str(BIN / 'torchrun')
NAMES = [f'shard_{i:05d}.arrow' for i in range(5)]


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    "Sample shards, a small tokenizer, and the root a single process makes of them (the reference)."
    d = tmp_path_factory.mktemp('corpus')
    make_sample_shards(d / 'src')
    train_tokenizer(d / 'src', vocab_size=512, out_dir=d / 'tok', progress=False)
    tokenize(d / 'src', d / 'ref', 'web', d / 'tok', workers=2, split='all', progress=False, verbose=False)   # all 5
    return d


def _cli(*args, cwd=None, env=None, timeout=240):
    return subprocess.run([CLI, 'tokenize', '--split', 'all', *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, **(env or {})), timeout=timeout)


def _same_as_reference(root, corpus, dataset='web'):
    "The files and the manifest's records are those of the single-process run, byte for byte."
    ref = read_manifest(corpus / 'ref')['datasets']['web']
    got = read_manifest(root)['datasets'][dataset]
    assert got['files'] == ref['files'] and got['tokenizer'] == ref['tokenizer']
    for n in NAMES: assert (root / dataset / n).read_bytes() == (corpus / 'ref' / 'web' / n).read_bytes()
    assert (root / 'meta' / 'combined_counts.csv').read_text() == (corpus / 'ref' / 'meta' / 'combined_counts.csv').read_text()
    assert os.listdir(root / 'meta' / '.records' / dataset) == []


@pytest.mark.parametrize('args, msg', [
    ([], "out (--out) is required: the token root that holds one folder per dataset"),
    (['--out', '{o}'], "dataset (--dataset) is required: the name of the dataset's folder under the token root"),
    (['--out', '{o}', '--dataset', '.web'], "dataset '.web' is invalid: expected a folder name"),
    (['--out', '{o}', '--dataset', 'web', '-w', '0'], "workers=0 is invalid: expected an int >= 1"),
    (['--out', '{o}', '--dataset', 'web', '--rank', '1'], "rank and world_size go together: give both or neither"),
    (['--out', '{o}', '--dataset', 'web', '--rank', '2', '--world-size', '2'], "rank=2 is invalid for world_size=2: expected 0 <= rank < world_size"),
    (['--out', '{o}', '--dataset', 'web', '--split', 'test'], "split 'test' is invalid: expected one of all, train, val"),
    (['--out', '{o}', '--dataset', 'web', '--wait', '-1'], "wait=-1.0 is invalid: expected seconds > 0"),
    (['--out', '{o}', '--dataset', 'web', '--tokenizer-dir', '{c}/nothing'], "no trained tokenizer in {c}/nothing"),
    (['--out', '{o}', '--dataset', 'web', '--data-dir', '{c}/tok'], "no .parquet shards in {c}/tok"),
])
def test_bad_arguments_exit_2_with_one_line(corpus, tmp_path, capsys, args, msg):
    base = ['--data-dir', str(corpus / 'src'), '--tokenizer-dir', str(corpus / 'tok'), '--no-progress']
    fill = lambda s: s.format(o=tmp_path / 'out', c=corpus)
    assert main(['tokenize', *base, *map(fill, args)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nanochat-dl tokenize: error: {fill(msg)}") and err.count('\n') == 1, err
    assert not (tmp_path / 'out').exists()


def test_the_command_writes_then_keeps(corpus, tmp_path):
    r = _cli('--data-dir', corpus / 'src', '--out', tmp_path, '--dataset', 'web', '--tokenizer-dir', corpus / 'tok', '-w', '2', '--no-progress')
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"tokenize: 5 of 5 shards of {corpus / 'src'} -> {tmp_path / 'web'} (rank 0 of 1, 2 workers): 5 to do, 0 finished before"
    n_docs = sum(f["documents"] for f in read_manifest(corpus / "ref")["datasets"]["web"]["files"].values())
    assert lines[1].startswith(f"rank 0: 5 written ({n_docs:,} documents, ") and lines[2].startswith(f"wrote {tmp_path}/meta/combined_counts.csv and ")
    _same_as_reference(tmp_path, corpus)
    r = _cli('--data-dir', corpus / 'src', '--out', tmp_path, '--dataset', 'web', '--tokenizer-dir', corpus / 'tok', '--no-progress')
    assert r.returncode == 0 and r.stdout.splitlines()[0].endswith(': 0 to do, 5 finished before'), r.stdout + r.stderr


def test_a_corrupt_shard_is_named_the_others_finish_exit_1(corpus, tmp_path):
    src = Path(shutil.copytree(corpus / 'src', tmp_path / 'src'))
    (src / 'shard_00002.parquet').write_bytes(b'PAR1 this is not parquet')
    r = _cli('--data-dir', src, '--out', tmp_path / 'out', '--dataset', 'web', '--tokenizer-dir', corpus / 'tok', '--no-progress')
    assert r.returncode == 1
    err = r.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith(f"nanochat-dl tokenize: error: shard_00002.arrow: {src}/shard_00002.parquet: "
                                               "not a readable parquet shard ("), r.stderr
    assert sorted(os.listdir(tmp_path / 'out' / 'web')) == [n for n in NAMES if n != 'shard_00002.arrow']
    assert not (tmp_path / 'out' / 'meta' / 'manifest.json').exists()
    (src / 'shard_00002.parquet').write_bytes((corpus / 'src' / 'shard_00002.parquet').read_bytes())   # mended: only it is done
    r = _cli('--data-dir', src, '--out', tmp_path / 'out', '--dataset', 'web', '--tokenizer-dir', corpus / 'tok', '--no-progress')
    assert r.returncode == 0 and ': 1 to do, 4 finished before' in r.stdout, r.stdout + r.stderr


def test_two_ranks_as_two_processes(corpus, tmp_path):
    args = ['--data-dir', corpus / 'src', '--out', tmp_path, '--dataset', 'web', '--tokenizer-dir', corpus / 'tok', '-w', '1',
            '--split', 'all', '--world-size', '2', '--no-progress', '--wait', '120']
    procs = [subprocess.Popen([CLI, 'tokenize', *map(str, args), '--rank', str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert ': 3 to do' in outs[0][0] and ': 2 to do' in outs[1][0] and 'wrote' not in outs[1][0]
    _same_as_reference(tmp_path, corpus)


def test_rank_0_gives_up_naming_what_is_missing(corpus, tmp_path):
    r = _cli('--data-dir', corpus / 'src', '--out', tmp_path, '--dataset', 'web', '--tokenizer-dir', corpus / 'tok', '--rank', '0',
             '--world-size', '2', '--wait', '0.5', '--no-progress')
    assert r.returncode == 1
    assert r.stderr == ("nanochat-dl tokenize: error: rank 0 waited 0.5 s without a new shard finishing; 2 of 5 are not done: "
                        "shard_00001.arrow (rank 1), shard_00003.arrow (rank 1). Run those ranks again (finished shards are kept), "
                        "then rank 0, which writes the manifest\n")
    assert sorted(os.listdir(tmp_path / 'meta' / '.records' / 'web')) == [f'{n}.json' for n in NAMES[0::2]]


GLOO = """
import sys, time, torch.distributed as dist
from nanochat_dl.tokens import tokenize
dist.init_process_group('gloo')
if dist.get_rank() == 1: time.sleep(3)     # rank 0 finishes first; without the barrier its 1 ms wait would give up
res = tokenize(sys.argv[1], sys.argv[2], 'web', sys.argv[3], workers=1, split='all',
               wait=0.001 if dist.get_rank() == 0 else 600, progress=False)
print('RESULT', dist.get_rank(), dist.get_world_size(), len(res.done), res.manifest is not None, flush=True)
dist.destroy_process_group()
"""


def _torchrun(*args, timeout=240):
    if not Path(TORCHRUN).exists(): pytest.skip('torchrun is not installed')
    return subprocess.run([TORCHRUN, '--standalone', '--nproc_per_node', '2', *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS='1'))


@pytest.mark.timeout(300)
def test_torchrun_with_a_gloo_group(corpus, tmp_path):
    "With a process group, rank 0 waits at a barrier for rank 1, which starts late, instead of polling for its records."
    (tmp_path / 'job.py').write_text(textwrap.dedent(GLOO))
    r = _torchrun(tmp_path / 'job.py', corpus / 'src', tmp_path / 'out', corpus / 'tok')
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert sorted(l for l in r.stdout.splitlines() if l.startswith('RESULT')) == ['RESULT 0 2 3 True', 'RESULT 1 2 2 False']
    _same_as_reference(tmp_path / 'out', corpus)


@pytest.mark.timeout(300)
def test_torchrun_the_command_reads_rank_and_world_size(corpus, tmp_path):
    r = _torchrun('--no-python', CLI, 'tokenize', '--data-dir', corpus / 'src', '--out', tmp_path, '--dataset', 'web',
                  '--tokenizer-dir', corpus / 'tok', '-w', '1', '--split', 'all', '--no-progress', '--wait', '120')
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert '(rank 0 of 2, 1 workers): 3 to do' in r.stdout and '(rank 1 of 2, 1 workers): 2 to do' in r.stdout
    _same_as_reference(tmp_path, corpus)


def test_workers_cannot_import_from_the_current_folder(corpus, tmp_path):
    "Modules in the folder the command runs from never replace the real ones in the worker processes."
    here = tmp_path / 'here'; here.mkdir()
    for mod in ('numpy', 'pyarrow', 'tiktoken', 'json'): (here / f'{mod}.py').write_text(f"raise ImportError('the {mod}.py of the current folder')\n")
    (here / 'nanochat_dl').mkdir(); (here / 'nanochat_dl' / '__init__.py').write_text("raise ImportError('a nanochat_dl of the current folder')\n")
    r = _cli('--data-dir', corpus / 'src', '--out', tmp_path / 'out', '--dataset', 'web', '--tokenizer-dir', corpus / 'tok', '--no-progress', cwd=here)
    assert r.returncode == 0, r.stderr
    _same_as_reference(tmp_path / 'out', corpus)


def _children(name, parent=None):
    "Pids of the children of `parent` (default: this process) whose command line holds `name` (Linux /proc)."
    out, parent = [], os.getpid() if parent is None else parent
    for p in Path('/proc').iterdir():
        try:
            if p.name.isdigit() and int((p / 'stat').read_text().rsplit(')', 1)[1].split()[1]) == parent \
                    and name in (p / 'cmdline').read_bytes().decode(errors='replace'): out.append(int(p.name))
        except (OSError, ValueError, IndexError): pass
    return out


@pytest.mark.skipif(not Path('/proc/self/stat').exists(), reason='needs Linux /proc')
def test_a_worker_killed_mid_shard_fails_that_shard_alone(corpus, tmp_path):
    text = ' '.join(f'word{i} and some more text' for i in range(150))
    w = pq.ParquetWriter(tmp_path / 'big.parquet', pa.schema([('text', pa.string())]))
    for g in range(150): w.write_table(pa.table({'text': [f'{g} {text}'] * 40}))
    w.close()
    shutil.copy(corpus / 'src' / 'shard_00000.parquet', tmp_path / 'small.parquet')
    killed = []
    def on_progress(docs, chars):
        if not killed:
            pids = _children('_serve_tokenize'); assert len(pids) == 1, pids
            os.kill(pids[0], signal.SIGKILL); killed.append(pids[0])
    tasks = [(tmp_path / 'big.parquet', tmp_path / 'out' / 'big.arrow'), (tmp_path / 'small.parquet', tmp_path / 'out' / 'small.arrow')]
    out = run_tasks(tasks, corpus / 'tok', workers=1, on_progress=on_progress)
    assert out['big.arrow'].startswith(f"{tmp_path}/big.parquet: the worker tokenizing it died (exit code -9): "), out['big.arrow']
    assert out['small.arrow']['documents'] == pq.ParquetFile(tmp_path / 'small.parquet').metadata.num_rows   # the replacement worker did the next shard
    assert sorted(os.listdir(tmp_path / 'out'))[-1] == 'small.arrow' and not (tmp_path / 'out' / 'big.arrow').exists()
    assert _children('_serve_tokenize') == []


def test_a_worker_that_cannot_start_stops_the_run(corpus, tmp_path):
    with pytest.raises(RuntimeError, match=r"^a tokenize worker failed to start \(exit code 1\): .*FileNotFoundError: no tokenizer directory at "
                                           + str(tmp_path / 'gone')):
        run_tasks([(corpus / 'src' / 'shard_00000.parquet', tmp_path / 'a.arrow')], tmp_path / 'gone', workers=2)
    assert list(tmp_path.iterdir()) == []


LOCKER = """
import sys, time
from pathlib import Path
from nanochat_dl.core import folder_lock
root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
with folder_lock(root):
    print('locked', flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_rank0_writes_counts_and_manifest_under_the_folder_lock(corpus, tmp_path, monkeypatch):
    "Two tokenize runs into one root (other datasets) must not interleave their read-modify-write of the counts and manifest."
    import nanochat_dl.core as core
    monkeypatch.setattr(core, 'LOCK_WAIT_S', 0.3)
    root = tmp_path / 'root'
    holder = subprocess.Popen([sys.executable, '-c', LOCKER, str(root), '30'], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == 'locked\n'
        with pytest.raises(ValueError, match=r"is being written by another process \(pid \d+"):
            tokenize(corpus / 'src', root, 'web', corpus / 'tok', workers=1, split='all', progress=False, verbose=False)
    finally: holder.kill(); holder.wait()
    assert read_manifest(root) is None and not (root / 'meta' / 'combined_counts.csv').exists()
    tokenize(corpus / 'src', root, 'web', corpus / 'tok', workers=1, split='all', progress=False, verbose=False)
    _same_as_reference(root, corpus)


def test_text_that_is_not_utf8(corpus, tmp_path, capsys):
    """A shard with a row that is not UTF-8: the shard fails naming its row and the option that reads it, the others are
    written; `--utf8-errors replace` (`utf8_errors='replace'`) tokenizes it with U+FFFD for the undecodable bytes."""
    from nanochat_dl.tokens import TokenFile
    src = tmp_path / 'src'; src.mkdir()
    bad = pa.array([b'alpha beta', b'caf\xe9 au lait', b'gamma'], pa.binary()).view(pa.string())
    pq.write_table(pa.table({'text': bad}), src / 'shard_00000.parquet')
    pq.write_table(pa.table({'text': ['delta epsilon', 'zeta']}), src / 'shard_00001.parquet')
    base = ['tokenize', '--data-dir', str(src), '--dataset', 'web', '--tokenizer-dir', str(corpus / 'tok'),
            '--no-progress', '--split', 'all']
    assert main(base + ['--out', str(tmp_path / 'a')]) == 1
    err = capsys.readouterr().err
    assert f"shard_00000.arrow: {src / 'shard_00000.parquet'}: row group 0, row 1: 'text' is not valid UTF-8" in err, err
    assert "tokenize: --utf8-errors replace" in err, err
    assert os.listdir(tmp_path / 'a' / 'web') == ['shard_00001.arrow']
    assert main(base + ['--out', str(tmp_path / 'b'), '--utf8-errors', 'bogus']) == 2
    assert "utf8_errors='bogus' is invalid" in capsys.readouterr().err
    assert main(base + ['--out', str(tmp_path / 'b'), '--utf8-errors', 'replace']) == 0, capsys.readouterr().err
    tok = Tokenizer.load(corpus / 'tok')
    with TokenFile(tmp_path / 'b' / 'web' / 'shard_00000.arrow') as tf:
        assert [tok.decode(tf.doc(i)) for i in range(len(tf))] == ['alpha beta', 'caf\ufffd au lait', 'gamma']
    res = tokenize(src, tmp_path / 'c', 'web', corpus / 'tok', workers=1, split='all', progress=False, verbose=False,
                   utf8_errors='replace')
    assert not res.failed and (tmp_path / 'c' / 'web' / 'shard_00000.arrow').read_bytes() == (tmp_path / 'b' / 'web' / 'shard_00000.arrow').read_bytes()


# ---------------------------------------------------------------- resume, Ctrl-C, orphans, two runs, content keys

def _alive(pid) -> bool:
    "Whether process `pid` still runs (a zombie does not)."
    try: return (Path('/proc') / str(pid) / 'stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError: return False


def _until(cond, timeout=120, poll=0.005):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, 'timed out'
        time.sleep(poll)


def _finished(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith('.arrow') and not f.startswith('.')) if folder.is_dir() else []


@pytest.mark.skipif(not Path('/proc/self/stat').exists(), reason='needs Linux /proc')
@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGINT])
def test_a_killed_run_keeps_what_it_finished(corpus, tmp_path, sig):
    """A real run killed (SIGKILL) or interrupted (Ctrl-C's SIGINT) after 2 of its 5 shards: those are recorded as they
    finished, the rerun does only the rest, and the result is byte for byte a clean run's. Ctrl-C exits 130 with one line."""
    out = tmp_path / 'out'
    args = ['--data-dir', corpus / 'src', '--out', out, '--dataset', 'web', '--tokenizer-dir', corpus / 'tok',
            '-w', '1', '--no-progress', '--split', 'all']
    proc = subprocess.Popen([CLI, 'tokenize', *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    recs = out / 'meta' / '.records' / 'web'
    _until(lambda: proc.poll() is not None or (recs.is_dir() and len([f for f in os.listdir(recs) if f.endswith('.json')]) >= 2))
    at_kill = _finished(out / 'web')
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert len(at_kill) < 5, 'the shards were recorded only once all were done'
    kept = sorted(f for f in os.listdir(recs) if f.endswith('.json'))   # (a SIGKILL may leave a half-written one's temp file)
    assert 2 <= len(kept) < 5 and kept == [f'{n}.json' for n in NAMES[:len(kept)]]
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and err == (f"nanochat-dl tokenize: interrupted: {len(kept)} of 5 shards are finished and kept "
                                                  "(a rerun skips them), partial files removed; run it again to do the rest\n"), err
        assert _finished(out / 'web') == sorted(os.listdir(out / 'web'))      # no temp file left
    else: assert proc.returncode == -signal.SIGKILL
    r = _cli(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].endswith(f": {5 - len(kept)} to do, {len(kept)} finished before"), r.stdout
    _same_as_reference(out, corpus)


def _big_shard(path, docs=12_000):
    "A shard of one row group that takes one worker many seconds (it says nothing on its pipe until the row group is done)."
    text = ' '.join(f'word{i} and some more text' for i in range(150))
    pq.write_table(pa.table({'text': [f'{g} {text}' for g in range(docs)]}), path, row_group_size=docs)


@pytest.mark.skipif(not Path('/proc/self/stat').exists(), reason='needs Linux /proc')
def test_workers_stop_when_the_command_is_killed(corpus, tmp_path):
    "kill -9 of the command in the middle of a long shard: its worker does not work on as an orphan."
    (tmp_path / 'src').mkdir(); _big_shard(tmp_path / 'src' / 'shard_00000.parquet')
    proc = subprocess.Popen([CLI, 'tokenize', '--data-dir', str(tmp_path / 'src'), '--out', str(tmp_path / 'out'), '--dataset', 'web',
                             '--tokenizer-dir', str(corpus / 'tok'), '-w', '1', '--no-progress', '--split', 'all'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    web = tmp_path / 'out' / 'web'
    _until(lambda: proc.poll() is not None or (web.is_dir() and any(f.startswith('.') and f.endswith('.tmp') for f in os.listdir(web))))
    workers = _children('_serve_tokenize', proc.pid)
    assert proc.poll() is None and len(workers) == 1, workers
    proc.kill(); proc.wait()
    end = time.monotonic() + 3
    while any(map(_alive, workers)) and time.monotonic() < end: time.sleep(0.05)
    alive = [w for w in workers if _alive(w)]
    for w in alive: os.kill(w, signal.SIGKILL)
    assert not alive, 'the worker worked on after its parent was killed'
    assert not (web / 'shard_00000.arrow').exists()


@pytest.mark.skipif(not Path('/proc/self/stat').exists(), reason='needs Linux /proc')
def test_a_second_run_into_the_same_dataset_waits_then_exits_2(corpus, tmp_path, capsys, monkeypatch):
    "A second `tokenize` of the dataset another one is writing waits (here 0.5 s), then exits 2 naming the first's pid, leaving its work alone."
    import nanochat_dl.core as core
    monkeypatch.setattr(core, 'LOCK_WAIT_S', 0.5)
    out = tmp_path / 'out'
    args = ['--data-dir', corpus / 'src', '--out', out, '--dataset', 'web', '--tokenizer-dir', corpus / 'tok',
            '-w', '1', '--no-progress', '--split', 'all']
    first = subprocess.Popen([CLI, 'tokenize', *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        web = out / 'web'
        _until(lambda: first.poll() is not None or (web.is_dir() and any(f.endswith('.tmp') for f in os.listdir(web))))
        assert main(['tokenize', *map(str, args)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"nanochat-dl tokenize: error: another `tokenize` of dataset 'web' (rank 0) into {out} is running: ") \
            and f"(pid {first.pid}, which holds " in err and err.count('\n') == 1, err
        assert first.poll() is None, 'the first run ended before the second gave up: make it slower'
        o, e = first.communicate(timeout=240)
    finally:
        if first.poll() is None: first.kill()
    assert first.returncode == 0 and ': 5 to do, 0 finished before' in o, o + e
    _same_as_reference(out, corpus)


def _shards(src, texts):
    "Shards written byte-stably (no compression, dictionary or statistics), so an edit of one character keeps the size."
    src.mkdir(exist_ok=True)
    for i, t in enumerate(texts):
        pq.write_table(pa.table({'text': t}), src / f'shard_{i:05d}.parquet', compression='none', use_dictionary=False, write_statistics=False)


def test_a_source_edited_in_place_at_the_same_size_is_done_again(corpus, tmp_path):
    "Finished work is keyed on the source shard's content (sha256), not its name and size; a record without that key is redone."
    from nanochat_dl.tokens import TokenFile
    tok, kw = Tokenizer.load(corpus / 'tok'), dict(workers=1, split='all', progress=False, verbose=False)
    texts = [['alpha beta gamma', 'delta epsilon'], ['zeta eta theta', 'iota kappa']]
    _shards(tmp_path / 'src', texts)
    footer = lambda b: b[-8 - int.from_bytes(b[-8:-4], 'little'):]          # the parquet footer: metadata, its length, PAR1
    before = (tmp_path / 'src' / 'shard_00001.parquet').read_bytes()
    tokenize(tmp_path / 'src', tmp_path / 'out', 'web', corpus / 'tok', **kw)
    texts[1][0] = 'zeta eta thetb'
    _shards(tmp_path / 'src', texts)
    after = (tmp_path / 'src' / 'shard_00001.parquet').read_bytes()
    assert len(after) == len(before) and after != before and footer(after) == footer(before)   # a footer digest would not see it
    res = tokenize(tmp_path / 'src', tmp_path / 'out', 'web', corpus / 'tok', **kw)
    assert (res.done, res.skipped) == (['shard_00001.arrow'], ['shard_00000.arrow'])
    with TokenFile(tmp_path / 'out' / 'web' / 'shard_00001.arrow') as tf:
        assert [tok.decode(tf.doc(i)) for i in range(len(tf))] == texts[1]
    m = read_manifest(tmp_path / 'out')
    assert m['datasets']['web']['files']['shard_00001.arrow']['source']['sha256'] == \
        hashlib.sha256((tmp_path / 'src' / 'shard_00001.parquet').read_bytes()).hexdigest()
    for r in m['datasets']['web']['files'].values(): del r['source']['sha256']          # a manifest written before the key
    (tmp_path / 'out' / 'meta' / 'manifest.json').write_text(json.dumps(m))
    res = tokenize(tmp_path / 'src', tmp_path / 'out', 'web', corpus / 'tok', **kw)
    assert (res.done, res.skipped) == (['shard_00000.arrow', 'shard_00001.arrow'], [])


# ---------------------------------------------------------------- the train split by default, empty documents

def test_the_default_is_the_train_split_and_val_goes_apart(corpus, tmp_path):
    """`tokenize` with its defaults takes the train split: files only from the first N-1 shards, none of the val shard's
    documents in them; the val shard goes into the same root as its own dataset, and a loader reads either by its weight."""
    from nanochat_dl.tokens import TokenFile, read_counts
    from nanochat_dl.tokens.loader import StreamingLoader
    root, tok = tmp_path / 'root', Tokenizer.load(corpus / 'tok')
    texts = {s.stem: pq.read_table(s).column('text').to_pylist() for s in sorted((corpus / 'src').glob('*.parquet'))}
    res = tokenize(corpus / 'src', root, 'web', corpus / 'tok', workers=2, progress=False, verbose=False)
    assert sorted(os.listdir(root / 'web')) == NAMES[:4] and res.done == NAMES[:4]
    assert res.documents == sum(len(texts[n[:-6]]) for n in NAMES[:4])
    val = {tuple(ids) for ids in tok.encode(texts['shard_00004'])}
    for n in NAMES[:4]:
        with TokenFile(root / 'web' / n) as tf: assert not val & {tuple(tf.doc(i).tolist()) for i in range(len(tf))}, n
    assert read_manifest(root)['datasets']['web']['source']['split'] == 'train'
    assert main(['tokenize', '--data-dir', str(corpus / 'src'), '--out', str(tmp_path / 'cli'), '--dataset', 'web',
                 '--tokenizer-dir', str(corpus / 'tok'), '-w', '1', '--no-progress']) == 0          # the command's default too
    assert sorted(os.listdir(tmp_path / 'cli' / 'web')) == NAMES[:4]
    assert main(['tokenize', '--data-dir', str(corpus / 'src'), '--out', str(root), '--dataset', 'web-val', '--split', 'val',
                 '--tokenizer-dir', str(corpus / 'tok'), '-w', '1', '--no-progress']) == 0          # the README's second command
    assert sorted(p.name for p in (root / 'meta').iterdir() if not p.name.startswith('.')) == ['combined_counts.csv', 'manifest.json']
    assert sorted(read_manifest(root)['datasets']) == ['web', 'web-val']
    assert sorted(read_counts(root, ['web', 'web-val'])) == [('web', n) for n in NAMES[:4]] + [('web-val', NAMES[4])]
    for ds in ('web', 'web-val'):
        with StreamingLoader(root, 32, 2, weights={ds: 1}, shuffle_window=0, prefetch=0) as ld:
            seen = {s.key.dataset for _ in range(20) for row in next(ld).segments for s in row}
        assert seen == {ds}, (ds, seen)


def test_the_split_default_rebuilds_old_manifests_as_they_were(corpus, tmp_path):
    "A manifest's source record without a split was written when the default was 'all': its rebuild hint says `--split all`."
    from nanochat_dl.tokens import rebuild_command
    rec = lambda **kw: dict(source=dict(data_dir='/s', tokenizer_dir='/t', **kw))
    base = f"`nanochat-dl tokenize --data-dir /s --out {tmp_path} --dataset web --tokenizer-dir /t"
    assert rebuild_command(tmp_path, 'web', rec(split='train', keep_empty=False)) == base + '`'
    assert rebuild_command(tmp_path, 'web', rec(split='val', keep_empty=False)) == base + ' --split val`'
    assert rebuild_command(tmp_path, 'web', rec(split='all', keep_empty=True)) == base + ' --split all --keep-empty`'
    assert rebuild_command(tmp_path, 'web', rec()) == base + ' --split all --keep-empty`'           # written before either option


EMPTY = [['alpha beta', '', 'gamma', ''], ['', 'delta'], ['epsilon zeta', 'eta'], ['theta', '']]   # shard 2 has none


def test_empty_documents_are_dropped_and_counted_or_kept(corpus, tmp_path, capsys):
    """Texts that encode to no token are dropped by default, counted in the result, the summary and the records;
    `keep_empty=True` writes the old files byte for byte; a rerun with the other setting redoes the shards it changes."""
    from nanochat_dl.tokens import TokenFile, write_token_file
    tok, kw = Tokenizer.load(corpus / 'tok'), dict(workers=2, split='all', progress=False)
    _shards(tmp_path / 'src', EMPTY)
    res = tokenize(tmp_path / 'src', tmp_path / 'drop', 'web', corpus / 'tok', **kw)
    shutil.copytree(tmp_path / 'drop', tmp_path / 'ref')
    out = capsys.readouterr().out
    assert res.dropped_empty == 4 and res.documents == 6 and 'dropped 4 empty documents' in out, out
    for i, t in enumerate(EMPTY):
        with TokenFile(tmp_path / 'drop' / 'web' / f'shard_{i:05d}.arrow') as tf:
            assert [tok.decode(tf.doc(j)) for j in range(len(tf))] == [x for x in t if x] and all(tf.lens > 0)
    m = read_manifest(tmp_path / 'drop')['datasets']['web']
    assert m['source']['keep_empty'] is False and [r['source']['empty'] for _, r in sorted(m['files'].items())] == [2, 1, 0, 1]
    res = tokenize(tmp_path / 'src', tmp_path / 'keep', 'web', corpus / 'tok', keep_empty=True, verbose=False, **kw)
    assert res.dropped_empty == 0 and res.documents == 10
    for i, t in enumerate(EMPTY):                                       # the bytes the code wrote before the option
        write_token_file(tmp_path / 'old' / f'{i}.arrow', tok.encode(t))
        assert (tmp_path / 'keep' / 'web' / f'shard_{i:05d}.arrow').read_bytes() == (tmp_path / 'old' / f'{i}.arrow').read_bytes()
    res = tokenize(tmp_path / 'src', tmp_path / 'drop', 'web', corpus / 'tok', keep_empty=True, verbose=False, **kw)
    assert (res.done, res.skipped) == ([NAMES[0], NAMES[1], NAMES[3]], [NAMES[2]])   # shard 2 is the same either way
    assert read_manifest(tmp_path / 'drop') == read_manifest(tmp_path / 'keep')
    for n in NAMES[:4]: assert (tmp_path / 'drop' / 'web' / n).read_bytes() == (tmp_path / 'keep' / 'web' / n).read_bytes()
    assert main(['tokenize', '--data-dir', str(tmp_path / 'src'), '--out', str(tmp_path / 'keep'), '--dataset', 'web', '--split', 'all',
                 '--tokenizer-dir', str(corpus / 'tok'), '-w', '1', '--no-progress', '--keep-empty']) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(': 0 to do, 4 finished before')
    res = tokenize(tmp_path / 'src', tmp_path / 'keep', 'web', corpus / 'tok', verbose=False, **kw)   # and back
    assert (res.done, res.skipped, res.dropped_empty) == ([NAMES[0], NAMES[1], NAMES[3]], [NAMES[2]], 4)
    assert read_manifest(tmp_path / 'keep') == read_manifest(tmp_path / 'ref')


def test_empty_documents_resume_ranks_and_old_records(corpus, tmp_path, capsys):
    """Dropping empty documents holds across a run stopped half way (its finished shards kept), across ranks (rank 0's
    summary counts every rank's), and a record written before the option (empty texts kept) is redone."""
    kw = dict(workers=1, split='all', progress=False)
    _shards(tmp_path / 'src', EMPTY)
    tokenize(tmp_path / 'src', tmp_path / 'ref', 'web', corpus / 'tok', verbose=False, **kw)
    with pytest.raises(TimeoutError):                                   # rank 0 of 2 alone: half the shards, then it stops
        tokenize(tmp_path / 'src', tmp_path / 'r', 'web', corpus / 'tok', rank=0, world_size=2, wait=0.1, verbose=False, **kw)
    res = tokenize(tmp_path / 'src', tmp_path / 'r', 'web', corpus / 'tok', verbose=False, **kw)
    assert (res.done, res.skipped, res.dropped_empty) == ([NAMES[1], NAMES[3]], [NAMES[0], NAMES[2]], 2)
    assert read_manifest(tmp_path / 'r') == read_manifest(tmp_path / 'ref')
    for n in NAMES[:4]: assert (tmp_path / 'r' / 'web' / n).read_bytes() == (tmp_path / 'ref' / 'web' / n).read_bytes()
    r1 = tokenize(tmp_path / 'src', tmp_path / 'r2', 'web', corpus / 'tok', rank=1, world_size=2, verbose=False, **kw)
    capsys.readouterr()
    r0 = tokenize(tmp_path / 'src', tmp_path / 'r2', 'web', corpus / 'tok', rank=0, world_size=2, **kw)
    assert (r0.dropped_empty, r1.dropped_empty) == (2, 2)
    assert 'tokens; dropped 4 empty documents' in capsys.readouterr().out           # every rank's, merged
    assert read_manifest(tmp_path / 'r2') == read_manifest(tmp_path / 'ref')
    m = read_manifest(tmp_path / 'r')
    for r in m['datasets']['web']['files'].values(): del r['source']['empty'], r['source']['keep_empty']   # before the option
    (tmp_path / 'r' / 'meta' / 'manifest.json').write_text(json.dumps(m))
    res = tokenize(tmp_path / 'src', tmp_path / 'r', 'web', corpus / 'tok', verbose=False, **kw)
    assert (res.done, res.skipped) == (NAMES[:4], [])
    assert read_manifest(tmp_path / 'r') == read_manifest(tmp_path / 'ref')


CC, WIKI = 'lang=en/dataset=commoncrawl', 'lang=en/dataset=wiki'


def test_nested_dataset_names_as_the_loaders_read_them(corpus, tmp_path, capsys):
    """`tokenize --dataset lang=en/dataset=commoncrawl` (fms-fsdp's names) writes ROOT/lang=en/dataset=commoncrawl/ with
    counts rows and a manifest entry under that name; two such datasets in one root are listed so and streamed by
    their names' weights, each document of each dataset once per epoch, whole; a name that overlaps a dataset of the
    root (one a folder of the other), or with a hidden part, is refused naming both."""
    from nanochat_dl.tokens import TokenFile, list_datasets, read_counts
    from nanochat_dl.tokens.loader import StreamingLoader
    root, kw = tmp_path / 'root', dict(workers=1, progress=False, verbose=False)
    tokenize(corpus / 'src', root, CC, corpus / 'tok', **kw)                               # the train shards
    assert main(['tokenize', '--data-dir', str(corpus / 'src'), '--out', str(root), '--dataset', WIKI, '--split', 'val',
                 '--tokenizer-dir', str(corpus / 'tok'), '-w', '1', '--no-progress']) == 0
    assert sorted(os.listdir(root / 'lang=en' / 'dataset=commoncrawl')) == NAMES[:4]
    assert list_datasets(root) == [CC, WIKI] and sorted(read_manifest(root)['datasets']) == [CC, WIKI]
    rows = (root / 'meta' / 'combined_counts.csv').read_text().splitlines()
    assert rows[1:] == sorted(rows[1:]) and [r.split(',')[0] for r in rows[1:]] == \
        [f'/{CC}/{n}' for n in NAMES[:4]] + [f'/{WIKI}/{NAMES[4]}']
    assert sorted(read_counts(root, [CC, WIKI])) == [(CC, n) for n in NAMES[:4]] + [(WIKI, NAMES[4])]
    want = {}
    for ds, names in ((CC, NAMES[:4]), (WIKI, NAMES[4:])):
        for n in names:
            with TokenFile(root / ds / n) as tf: want.update({(ds, n, i): len(tf.doc(i)) for i in range(len(tf))})
    got, seen = {}, {}
    with StreamingLoader(root, 128, 16, weights={CC: 1, WIKI: 1}, shuffle_window=50, prefetch=0) as ld:
        assert ld.config['datasets'] == [CC, WIKI]
        while len(seen) < 2 or min(seen.values()) < 3:
            for row in next(ld).segments:
                for s in row:
                    k = s.key
                    got[k] = got.get(k, 0) + s.length; seen[k.dataset] = max(seen.get(k.dataset, 0), k.epoch)
    for e in (1, 2): assert {(k.dataset, k.file, k.doc): n for k, n in got.items() if k.epoch == e} == want, e
    for bad, msg in ((f'{CC}/sub', f"dataset '{CC}/sub' overlaps dataset '{CC}' of {root}"),
                     ('lang=en', f"dataset 'lang=en' overlaps dataset '{CC}' of {root}"),
                     ('lang=en/.wiki', "dataset 'lang=en/.wiki' is invalid: expected a folder name")):
        assert main(['tokenize', '--data-dir', str(corpus / 'src'), '--out', str(root), '--dataset', bad,
                     '--tokenizer-dir', str(corpus / 'tok'), '-w', '1', '--no-progress']) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"nanochat-dl tokenize: error: {msg}") and err.count('\n') == 1, err
    assert list_datasets(root) == [CC, WIKI] and sorted(read_manifest(root)['datasets']) == [CC, WIKI]
