"""Tests for the loader (nanochat_dl.text.encode, .loader, .dataloader) that read better as pytest: a property test of exact resume over random
settings, the drop-in against the reference at several shapes, worker failures (a lost, hung or interrupted
worker, a constructor that fails after starting workers, a close with unread answers), and interpreter exit."""
import itertools, json, os, re, subprocess, sys, textwrap, time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.text.stages import reference_loader
from nanochat_dl.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat_dl.pipe.packing import STRATEGIES
from nanochat_dl.text.reader import RowGroupReader
from nanochat_dl.text.shards import split_files
from stateedit import DELETE, edited, paths   # a state's fields, and a copy with one edited
from toytext import raw_text_shard, toy_text_env, words


@pytest.fixture(scope='module')
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp('dl')
    e = toy_text_env(d, [[5, 3, 4], [2, 6, 1], [4, 4], [3, 3, 3]])   # the sample shards in base_data/, its tokenizer, toy/
    return dict(e, data=d / 'base_data', toy=e['files'])


def run(tok, n, **kw):
    with PackedLoader(tok, **kw) as ld:
        start = json.loads(json.dumps(ld.state_dict()))
        out = [(b.inputs.clone(), b.targets.clone(), json.loads(json.dumps(b.state))) for b in itertools.islice(ld, n)]
    return out, start


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(strategy=st.sampled_from(sorted(STRATEGIES)), B=st.integers(1, 4), T=st.integers(8, 48), buffer_size=st.integers(1, 12),
       tbs=st.integers(1, 7), world=st.sampled_from([(0, 1), (0, 2), (1, 2), (2, 3)]), shuffle=st.booleans(),
       cut=st.integers(0, 30), second=st.integers(0, 10))
def test_resume_is_exact(env, strategy, B, T, buffer_size, tbs, world, shuffle, cut, second):
    """Resuming from the state of any batch (and then again from a state of the resumed loader) continues the
    uninterrupted stream bit for bit, states included."""
    rank, ws = world
    kw = dict(files=env['toy'], batch_size=B, seq_len=T, pack=strategy, pack_buffer=buffer_size, tokenizer_batch_size=tbs, rank=rank,
              world_size=ws, shuffle=shuffle, seed=7, device='cpu', tokenizer_threads=1, tokenize_in='threads')
    n = cut + second + 12                                    # the uninterrupted run reaches past both resumes
    full, start = run(env['tok'], n, **kw)
    sd = start if cut == 0 else full[cut - 1][2]
    with PackedLoader(env['tok'], **kw, resume_state_dict=sd) as ld:
        again = [(b.inputs.clone(), b.targets.clone(), json.loads(json.dumps(b.state))) for b in itertools.islice(ld, second + 1)]
    for (x, y, s), (x0, y0, s0) in zip(again, full[cut:]):
        assert torch.equal(x, x0) and torch.equal(y, y0) and s == s0
    k = cut + len(again)
    with PackedLoader(env['tok'], **kw, resume_state_dict=again[-1][2]) as ld:
        for i, b in enumerate(itertools.islice(ld, n - k)):
            x0, y0, s0 = full[k + i]
            assert torch.equal(b.inputs, x0) and torch.equal(b.targets, y0) and json.loads(json.dumps(b.state)) == s0


@pytest.mark.parametrize('B,T,tbs,buf,rank,ws', [(1, 16, 1, 1, 0, 1), (3, 100, 7, 20, 0, 1), (8, 512, 128, 1000, 0, 1),
                                                 (2, 64, 16, 32, 1, 3), (4, 2048, 64, 200, 0, 2)])
def test_dropin_matches_reference(env, monkeypatch, B, T, tbs, buf, rank, ws):
    "The drop-in's batches are token for token those of nanochat's algorithm (the plain reference loader)."
    monkeypatch.setenv('NANOCHAT_DL_DATA_DIR', str(env['data']))
    monkeypatch.setenv('RANK', str(rank)); monkeypatch.setenv('WORLD_SIZE', str(ws)); monkeypatch.setenv('LOCAL_RANK', str(rank))
    ref = reference_loader(env['tok'], B, T, 'train', tokenizer_batch_size=tbs, buffer_size=buf)
    dl = tokenizing_distributed_data_loader_with_state_bos_bestfit(env['tok'], B, T, 'train', tokenizer_batch_size=tbs,
                                                                   device='cpu', buffer_size=buf)
    try:
        for _ in range(12):
            (x0, y0, s0), (x, y, s) = next(ref), next(dl)
            assert torch.equal(x0, x) and torch.equal(y0, y)
            assert s0 == {k: s[k] for k in s0}
            assert s['at_batch']['config']['rank'] == rank and s['at_batch']['config']['world_size'] == ws
    finally:
        dl.close(); ref.close()


def test_killed_worker_is_reported(env):
    ld = PackedLoader(env['tok'], 4, 256, data_dir=env['data'], device='cpu', tokenizer_threads=2, tokenize_in='processes')
    next(ld)
    enc = ld.encoder
    pids = [p.pid for p in enc._procs]
    for p in enc._procs: p.kill()
    with pytest.raises(RuntimeError, match=rf"tokenizer worker \d \(pid ({'|'.join(map(str, pids))})\) .*exit code -9"):
        for _ in range(200): next(ld)
    with pytest.raises(RuntimeError, match='stopped after an error'): next(ld)


def test_bad_text_column_names_the_file(env):
    with pytest.raises(ValueError, match=r"has no column 'body'"):
        ld = PackedLoader(env['tok'], 2, 32, files=env['toy'], text_column='body', device='cpu')
        next(ld)


SCRIPT = """
import os, sys, json
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.text.tokenizer import Tokenizer
tok = Tokenizer.load(sys.argv[2])
ld = PackedLoader(tok, 8, 512, data_dir=sys.argv[1], device='cpu', tokenizer_threads=2, tokenize_in=sys.argv[3], prefetch=3)
next(ld)
print(json.dumps([p.pid for p in getattr(ld.encoder, '_procs', [])]), flush=True)
# no close(): the interpreter must still exit promptly, and take the workers with it
"""


@pytest.mark.parametrize('mode', ['processes', 'threads'])
def test_interpreter_exit_with_a_live_loader(env, tmp_path, mode):
    script = tmp_path / 'live.py'
    script.write_text(textwrap.dedent(SCRIPT))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script), str(env['data']), str(env['tok_dir']), mode], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 30
    pids = json.loads(r.stdout.strip().splitlines()[-1])
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    assert len(pids) == (min(2, max(1, cpus - 1)) if mode == 'processes' else 0)   # processes: a usable CPU left to training
    def alive(pid):
        try: return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
        except OSError: return False
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"worker processes {pids} outlived the interpreter"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_process_encoder_never_deadlocks_on_full_pipes(env):
    """Several slices whose texts and answers are each far larger than a pipe's buffer, all submitted before any
    result is read: the parent must keep reading answers while it writes, or both sides would wait forever."""
    from nanochat_dl.text.encode import DocEncoder, ProcessEncoder
    big = [' '.join(f"word{i}x{j}" for j in range(20_000)) for i in range(48)]   # ~200 KB of text, ~60k+ ids each
    enc, ref = ProcessEncoder(env['tok'], 2), DocEncoder(env['tok'], 1)
    try:
        handles = [enc.submit(big[k:k + 16]) for k in range(0, len(big), 16)]
        got = [a for h in handles for a in enc.result(h)]
    finally: enc.close()
    want = ref(big)
    assert sum(map(len, want)) * 4 > 4 * (1 << 20)          # the answers alone exceed the pipes many times over
    assert len(got) == len(want) and all(a.tolist() == b.tolist() for a, b in zip(got, want))


def test_run_bench_table_at_a_toy_size(env):
    "The whole benchmark, one round at a toy size: every contender runs in its own process, the table has every line."
    from nanochat_dl.bench.loaders import run_bench, format_bench_table
    r = run_bench(env['data'], env['tok_dir'], B=4, T=256, warmup=1, batches=40, threads=2, buffer_size=2, repeats=1, progress=None)   # slices of 128 long documents enter inside the window
    assert r['identical'] is True and r['b_over_a'] > 0 and r['c_over_a'] > 0
    res = r['results']
    assert set(res) == {'reference', 'dropin', 'best', 'tokenize', 'read', 'dropin1', 'tokenize1'}
    assert res['reference']['outside_pct'] is None                    # its encoding time is not known
    if os.name == 'posix':   # worker processes: their encoding CPU is read with all their CPU, the share never falls below 0
        for k in ('dropin', 'best', 'tokenize', 'read', 'dropin1', 'tokenize1'): assert 0 <= res[k]['outside_pct'] <= 100, (k, res[k])
    assert res['tokenize']['tokenized'] == res['read']['tokenized'] == 3 * res['dropin']['tokenized']   # the same documents, three times
    assert set(r['of_tokenize_pct']) == set(r['of_tokenize_cpu_pct']) == {'dropin', 'best', 'dropin1', 'read'}
    assert all(v > 0 for v in r['of_tokenize_cpu_pct'].values())
    text = format_bench_table(r)
    for line in ('(a) reference loader', '(b) drop-in', '(c) bestfit-split', '(d) tokenize only', '(e) read+tokenize', "(b') drop-in, 1 worker",
                 "(d') tokenize, 1 worker", 'b/a = ', 'identical batches: True', 'c/a = ', 'CPU outside encoding',
                 'as a share of tokenizing alone', 'the same from CPU', '(b) training process CPU per batch', "(b) tokenizer workers' CPU"):
        assert line in text, line


# -- worker processes when things go wrong: nothing stale, nothing left running, nothing stuck ------------------------

def _my_workers() -> list[int]:
    "Live (not zombie) tokenizer worker processes whose parent is this process (Linux /proc)."
    out = []
    for d in Path('/proc').iterdir():
        if not d.name.isdigit(): continue
        try:
            stat, cmd = (d / 'stat').read_text(), (d / 'cmdline').read_bytes()
        except OSError: continue
        state, ppid = stat.rsplit(')', 1)[1].split()[:2]
        if int(ppid) == os.getpid() and state != 'Z' and b'nanochat_dl.text._tokworker' in cmd: out.append(int(d.name))
    return out


def _until(cond, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline: return False
        time.sleep(0.05)
    return True


linux_only = pytest.mark.skipif(not Path('/proc/self/stat').exists(), reason='reads /proc')


@pytest.mark.timeout(60)
def test_encoder_close_is_prompt_with_answers_nobody_read(env):
    """Answers larger than a pipe, never read: each worker is blocked writing. Closing hangs up on both pipes, so the
    workers exit at once (they used to be waited for 10 s each, then killed)."""
    from nanochat_dl.text.encode import ProcessEncoder
    enc = ProcessEncoder(env['tok'], 2)
    procs = list(enc._procs)
    enc.submit([' '.join(f"w{i}x{j}" for j in range(30_000)) for i in range(16)])   # ~8 MB of ids for 2 MiB of pipes
    time.sleep(1.0)                                                                   # let the workers fill their pipes
    t0 = time.monotonic(); enc.close(); took = time.monotonic() - t0
    assert all(p.poll() is not None for p in procs)
    assert took < 5, f"close() took {took:.1f} s"
    with pytest.raises(RuntimeError, match='is closed'): enc(['after close'])


def test_encoder_refuses_to_go_on_after_losing_a_worker(env):
    """A worker gone in the middle of a call leaves the other workers' answers in their pipes: the encoder must not
    hand them to the next call as if they were its own."""
    from nanochat_dl.text.encode import ProcessEncoder
    enc = ProcessEncoder(env['tok'], 2)
    try:
        enc._procs[0].kill(); enc._procs[0].wait()
        with pytest.raises(RuntimeError, match=r'tokenizer worker 0 .*exit code -9'): enc(['alpha alpha', 'beta beta'])
        with pytest.raises(RuntimeError, match='stopped after'): enc(['gamma'])
    finally: enc.close()


@linux_only
def test_a_loader_that_fails_to_start_leaves_no_workers(env, tmp_path):
    bad = tmp_path / 'shard_00000.parquet'
    bad.write_bytes(b'not parquet at all' * 100)
    before = set(_my_workers())
    with pytest.raises(ValueError, match=r'shard_00000\.parquet: not a readable parquet shard'):
        PackedLoader(env['tok'], 2, 64, files=[bad], device='cpu', tokenizer_threads=2, tokenize_in='processes')
    with pytest.raises(ValueError, match='read_ahead'):
        PackedLoader(env['tok'], 2, 64, files=env['toy'], device='cpu', tokenizer_threads=2, tokenize_in='processes', read_ahead=-1)
    assert _until(lambda: not set(_my_workers()) - before), f"workers left running: {set(_my_workers()) - before}"


@linux_only
@pytest.mark.timeout(60)
def test_close_frees_a_consumer_stuck_on_a_hung_worker(env, monkeypatch):
    """A worker that stops answering (SIGSTOP here) blocks the next batch. `close()` from another thread kills the
    workers once the background thread does not stop in time, and the waiting consumer gets a clear error."""
    import signal, threading
    from nanochat_dl.pipe import producer
    monkeypatch.setattr(producer, 'JOIN_TIMEOUT', 1.0)
    ld = PackedLoader(env['tok'], 4, 256, files=split_files('train', env['data']), device='cpu', tokenizer_threads=2,
                      tokenize_in='processes', pack_buffer=20)
    next(ld)
    procs = list(ld.encoder._procs)
    os.kill(procs[0].pid, signal.SIGSTOP)
    got = {}
    def consume():
        try:
            for _ in range(10_000): next(ld)
        except Exception as e: got['error'] = str(e)
    th = threading.Thread(target=consume, daemon=True); th.start()
    th.join(2.0)
    assert th.is_alive()                                   # waiting on the stopped worker
    ld.close()
    th.join(10)
    assert not th.is_alive() and 'closed while waiting' in got['error'], got
    assert all(p.poll() is not None for p in procs) and not ld._thread.is_alive()


@linux_only
@pytest.mark.timeout(60)
def test_worker_survives_ctrl_c(env):
    "Ctrl-C reaches every process of the terminal's group: the workers ignore it, the training script decides."
    import signal
    from nanochat_dl.text.encode import ProcessEncoder
    enc = ProcessEncoder(env['tok'], 1)
    try:
        want = enc(['hello world'])[0].tolist()
        os.kill(enc._procs[0].pid, signal.SIGINT)
        time.sleep(0.3)
        assert enc._procs[0].poll() is None
        assert enc(['hello world'])[0].tolist() == want
    finally: enc.close()


# -- worker processes import what the loader's process imports, never a file of the current directory ----------------

POISON = "open({marker!r}, 'a').write({name!r} + '\\n')\nraise ImportError('the {name}.py of the current directory was imported')\n"


def _poison(folder, marker):
    for name in ('tiktoken', 'numpy', 'regex', 'pyarrow'):
        (folder / f'{name}.py').write_text(POISON.format(marker=str(marker), name=name))


@pytest.mark.timeout(120)
def test_workers_ignore_modules_in_the_current_directory(env, tmp_path, monkeypatch):
    """A training run started in a folder that holds a `tiktoken.py` or `numpy.py`: the workers must not run them
    (`python -c` puts the current directory first on `sys.path`), they import what this process imported."""
    from nanochat_dl.text.encode import DocEncoder, ProcessEncoder
    marker = tmp_path / 'imported.txt'
    run_dir = tmp_path / 'run'; run_dir.mkdir()
    _poison(run_dir, marker)
    texts = [words(f, g, r) for f in range(3) for g in range(3) for r in range(5)]
    want = [a.tolist() for a in DocEncoder(env['tok'], 1)(texts)]
    kw = dict(files=env['toy'], device='cpu', tokenizer_threads=2, pack_buffer=6, tokenizer_batch_size=4)
    with PackedLoader(env['tok'], 2, 32, tokenize_in='threads', **kw) as ld:
        ref = [b.inputs.clone() for b in itertools.islice(ld, 5)]
    monkeypatch.chdir(run_dir)
    enc = ProcessEncoder(env['tok'], 2)
    try: got = [a.tolist() for a in enc(texts)]
    finally: enc.close()
    with PackedLoader(env['tok'], 2, 32, tokenize_in='processes', **kw) as ld:
        again = [b.inputs.clone() for b in itertools.islice(ld, 5)]
    assert not marker.exists(), marker.read_text()
    assert got == want and all(torch.equal(a, b) for a, b in zip(again, ref))


SOURCE_RUN = """
import json, sys
import nanochat_dl
from nanochat_dl.text.encode import ProcessEncoder
from nanochat_dl.text.tokenizer import Tokenizer
assert nanochat_dl.__file__.startswith(sys.argv[1]), nanochat_dl.__file__
enc = ProcessEncoder(Tokenizer.load(sys.argv[2]), 1)
ids = enc(['hello world', 'a second document'])
print(json.dumps([a.tolist() for a in ids]))
enc.close()
"""


@pytest.mark.timeout(120)
def test_workers_of_a_source_checkout_on_pythonpath(env, tmp_path):
    """The loader's process imports nanochat_dl from a source checkout named by PYTHONPATH (here a copy of the package)
    and runs in a folder with a poisoned `tiktoken.py`: the workers run the checkout's code and the installed tiktoken."""
    import shutil, nanochat_dl
    from nanochat_dl.text.encode import DocEncoder
    src = tmp_path / 'checkout'
    shutil.copytree(Path(nanochat_dl.__file__).parent, src / 'nanochat_dl', ignore=shutil.ignore_patterns('__pycache__'))
    scripts, run_dir, marker = tmp_path / 'scripts', tmp_path / 'run', tmp_path / 'imported.txt'
    scripts.mkdir(); run_dir.mkdir()
    _poison(run_dir, marker)
    (scripts / 'train.py').write_text(SOURCE_RUN)
    r = subprocess.run([sys.executable, str(scripts / 'train.py'), str(src), str(env['tok_dir'])], cwd=run_dir, capture_output=True,
                       text=True, timeout=100, env=dict(os.environ, PYTHONPATH=str(src)))
    assert r.returncode == 0, r.stderr
    assert not marker.exists(), marker.read_text()
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [a.tolist() for a in DocEncoder(env['tok'], 1)(['hello world', 'a second document'])]


def test_a_worker_with_other_modules_is_refused():
    "A worker whose tiktoken is not this process's (a path mix-up this test fakes) is refused, naming both files."
    from types import SimpleNamespace
    from nanochat_dl.text.procs import check_ready as _check_ready
    from nanochat_dl.text._tokworker import module_files
    w = SimpleNamespace(i=1, proc=SimpleNamespace(pid=4321))
    _check_ready(w, ('ready', module_files()))
    other = dict(module_files(), tiktoken='/elsewhere/tiktoken/__init__.py')
    with pytest.raises(RuntimeError, match=r"worker 1 \(pid 4321\) imported tiktoken from /elsewhere/tiktoken/__init__.py, but this process uses"):
        _check_ready(w, ('ready', other))
    with pytest.raises(RuntimeError, match="did not start properly: it answered 'ready'"): _check_ready(w, 'ready')


# -- a hung worker: detected, named, and no wait for it when closing ---------------------------------------------------

@linux_only
@pytest.mark.timeout(90)
def test_a_hung_worker_is_reported_by_next(env, monkeypatch):
    """A worker that stops answering (SIGSTOP) used to block `next()` forever without a word. With a short
    `worker_timeout` the loader raises, naming the worker, its pid, what it was sent and for how long; closing then
    kills it rather than waiting for it (a close that waited would wait for an hour here)."""
    import signal
    from nanochat_dl.text.encode import ProcessEncoder
    monkeypatch.setattr(ProcessEncoder.close, '__defaults__', (3600.0,))
    ld = PackedLoader(env['tok'], 4, 256, files=split_files('train', env['data']), device='cpu', tokenizer_threads=2,
                      tokenize_in='processes', pack_buffer=20, worker_timeout=(3.0, 0.0))
    next(ld)
    procs = list(ld.encoder._procs)
    os.kill(procs[0].pid, signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError) as e:
            for _ in range(10_000): next(ld)
        msg = str(e.value)
        assert re.search(rf"tokenizer worker 0 \(pid {procs[0].pid}\) was sent \d+ documents \([\d,]+ bytes of text\) [\d.]+ s ago "
                         r"and has not answered for [\d.]+ s \(allowed 3\.0 s: 3 s \+ 0 s per character\); its state: T \(stopped\): it looks hung", msg), msg
        ld.close()
        assert all(p.poll() is not None for p in procs)
    finally:
        for p in procs:
            if p.poll() is None: p.kill()


@linux_only
@pytest.mark.timeout(90)
def test_a_hung_worker_is_reported_while_sending(env):
    """The worker stops while the encoder writes it more than a pipe holds: the write can never finish. The encoder
    raises after the allowed time instead of waiting forever, refuses further calls, and closes without waiting."""
    import signal
    from nanochat_dl.text.encode import ProcessEncoder
    enc = ProcessEncoder(env['tok'], 1, timeout=(2.0, 0.0))
    pid = enc._procs[0].pid
    try:
        os.kill(pid, signal.SIGSTOP)
        big = [' '.join(f"w{i}x{j}" for j in range(100_000)) for i in range(8)]   # ~7 MB of text for a 1 MiB pipe
        with pytest.raises(RuntimeError, match=rf"tokenizer worker 0 \(pid {pid}\) has not read its input for [\d.]+ s \(allowed 2\.0 s: "
                                               r"2 s \+ 0 s per character\) while 8 documents \([\d,]+ characters\) wait to be sent"):
            enc.submit(big)
        with pytest.raises(RuntimeError, match='stopped after'): enc(['more'])
        enc.close(timeout=3600)
        assert enc_exited(pid)
    finally:
        if not enc_exited(pid): os.kill(pid, signal.SIGKILL)


def enc_exited(pid):
    try: return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] == 'Z'
    except OSError: return True


def test_worker_timeout_is_checked(env):
    for bad in [(0, 1e-5), (-1.0, 0.0), (60.0, -1.0), 60.0, (60.0,), ('a', 0.0), (True, 0.0)]:
        with pytest.raises(ValueError, match=r"worker_timeout=.* is invalid: expected None or \(seconds, seconds per character\)"):
            PackedLoader(env['tok'], 2, 32, files=env['toy'], device='cpu', worker_timeout=bad)


# -- next() from several threads ----------------------------------------------------------------------------------------

@pytest.mark.parametrize('prefetch', [0, 16])
def test_next_from_several_threads(env, prefetch):
    """Threads that share one loader get every batch of the single-threaded stream exactly once, each with its own
    state (`copy=True`: a batch's tensors are then its own, whoever fetched the batches after it)."""
    import threading
    kw = dict(files=split_files('train', env['data']), batch_size=16, seq_len=512, device='cpu', tokenizer_threads=1, tokenize_in='threads',
              pack_buffer=50, copy=True, prefetch=prefetch)
    n, k = 96, 6
    with PackedLoader(env['tok'], **kw) as ld:
        want = {b.state['stages']['batch']['step']: (b.inputs.clone(), b.targets.clone(), json.dumps(b.state)) for b in itertools.islice(ld, n)}
    got, errors = [], []
    with PackedLoader(env['tok'], **kw) as ld:
        start = threading.Barrier(k)
        def take():
            start.wait()
            try:
                for _ in range(n // k):
                    b = next(ld); got.append((b.state['stages']['batch']['step'], b.inputs, b.targets, json.dumps(b.state)))
            except Exception as e: errors.append(e)
        threads = [threading.Thread(target=take) for _ in range(k)]
        if prefetch: _until(lambda: ld._q.full(), 30)          # batches waiting: the threads take them at the same moment
        for t in threads: t.start()
        for t in threads: t.join(60)
    assert not errors, errors
    assert sorted(s for s, *_ in got) == list(range(1, n + 1))
    wrong = [s for s, x, y, st in got if not (torch.equal(x, want[s][0]) and torch.equal(y, want[s][1]) and st == want[s][2])]
    assert not wrong, f"{len(wrong)} of {n} batches differ from the single-threaded stream: steps {wrong[:10]}"


def test_invalid_utf8_in_a_shard(env, tmp_path):
    "The loader names the file, row group and row of text that is not UTF-8; `utf8_errors='replace'` reads it with U+FFFD."
    import numpy as np, pyarrow as pa, pyarrow.parquet as pq
    p = tmp_path / 'shard_00000.parquet'
    raw_text_shard(p, [[b'first document here', b'second \xc3 broken', b'third one']])
    kw = dict(files=[p], device='cpu', tokenizer_threads=1, tokenize_in='threads', pack_buffer=2, tokenizer_batch_size=2)
    with PackedLoader(env['tok'], 1, 8, **kw) as ld:
        with pytest.raises(ValueError, match=re.escape(f"{p}: row group 0, row 1: 'text' is not valid UTF-8 (invalid continuation byte at byte 7")):
            next(ld)
    with PackedLoader(env['tok'], 1, 8, **kw, utf8_errors='replace') as ld:
        b = next(ld)
    docs = {s.key[3]: s for row in b.segments for s in row}
    bos = env['tok'].get_bos_token_id()
    assert b.packed.rows[0][:docs[0].length].tolist() == [bos] + env['tok'].encode('first document here')[:docs[0].length - 1]


# -- exact resume over changed data -------------------------------------------------------------------------------------

def _plain_shards(d, layout, text_fn):
    "Uncompressed shards without dictionaries: texts of the same lengths give files of the same size."
    import pyarrow as pa, pyarrow.parquet as pq
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for f, groups in enumerate(layout):
        p = d / f"shard_{f:05d}.parquet"
        with pq.ParquetWriter(p, pa.schema([('text', pa.string())]), compression='none', use_dictionary=False) as w:
            for g, n in enumerate(groups): w.write_table(pa.table({'text': [text_fn(f, g, r) for r in range(n)]}))
        out.append(p)
    return out


def test_exact_resume_refuses_a_changed_shard_of_the_same_name_and_size(env, tmp_path):
    """A shard rewritten with other text of the same length keeps its name and size: a state saved over the old one
    used to resume into other batches without a word. It is refused, naming the shard."""
    layout = [[5, 3, 4], [2, 6, 1], [4, 4]]
    files = _plain_shards(tmp_path / 'data', layout, words)
    kw = dict(files=files, batch_size=2, seq_len=32, device='cpu', tokenizer_threads=1, tokenize_in='threads', pack_buffer=6, tokenizer_batch_size=4)
    with PackedLoader(env['tok'], **kw) as ld:
        sd = json.loads(json.dumps(list(itertools.islice(ld, 3))[-1].state))
    with PackedLoader(env['tok'], **kw, resume_state_dict=sd) as ld: assert ld.resumed == 'exact'
    size, data = files[1].stat().st_size, files[1].read_bytes()
    _plain_shards(tmp_path / 'new', layout, lambda f, g, r: words(f, g, r).replace('w', 'v'))
    files[1].write_bytes((tmp_path / 'new' / files[1].name).read_bytes())
    assert files[1].stat().st_size == size and files[1].read_bytes() != data
    with pytest.raises(ValueError, match=r"resume_state_dict\['fingerprint'\]: shard shard_00001\.parquet changed since the state was saved "
                                         r"\(same name and size, another parquet footer\)"):
        PackedLoader(env['tok'], **kw, resume_state_dict=sd)
    with PackedLoader(env['tok'], **kw, resume_state_dict={k: sd[k] for k in ('pq_idx', 'rg_idx', 'epoch')}) as ld:
        assert ld.resumed == 'approximate'                       # nanochat's state still continues, approximately


# -- hand-edited states: refused before any work, with the field named; or an exact resume --------------------------

TOYKW = dict(batch_size=2, seq_len=24, pack_buffer=6, tokenizer_batch_size=4, device='cpu', tokenizer_threads=1, tokenize_in='threads', prefetch=0)


@pytest.fixture(scope='module')
def runs(env):
    "For three strategies (whole documents, split pieces, concat remainders): 16 batches with their states, and the state at batch 9."
    out = {}
    for strategy in ('bestfit-crop', 'bestfit-split', 'concat'):
        full, _ = run(env['tok'], 16, files=env['toy'], pack=strategy, **TOYKW)
        out[strategy] = (full, full[8][2])
    return out


class Reads:
    "Counts documents read or encoded while it is active (a refused state must cost neither)."
    def __init__(self, monkeypatch):
        from nanochat_dl.text import encode, stages, shards
        self.n = 0
        for mod, name in ((stages, 'read_documents'), (shards, 'read_group'), (shards, '_read_column')):
            orig = getattr(mod, name)
            def spy(*a, _orig=orig, **k): self.n += 1; return _orig(*a, **k)
            monkeypatch.setattr(mod, name, spy)
        for cls, name in ((encode.DocEncoder, 'submit'), (encode.DocEncoder, 'submit_read'), (encode.ProcessEncoder, 'submit'),
                          (encode.ProcessEncoder, 'submit_read')):
            orig = getattr(cls, name)
            def spy_submit(me, *a, _orig=orig, **k): self.n += 1; return _orig(me, *a, **k)
            monkeypatch.setattr(cls, name, spy_submit)


def stages_with(sd, stage, **kv):
    "`sd` with some entries of one stage's state replaced."
    return {**sd, 'stages': {**sd['stages'], stage: {**sd['stages'][stage], **kv}}}


def refused(env, sd, strategy='bestfit-crop'):
    "The error a loader gives for state `sd` (after a JSON round trip), or None if it resumes."
    try:
        with PackedLoader(env['tok'], files=env['toy'], pack=strategy, **TOYKW, resume_state_dict=json.loads(json.dumps(sd))): return None
    except (ValueError, TypeError) as e: return e


def test_hand_edited_states_are_refused_naming_the_field(env, runs, monkeypatch):
    full, sd = runs['bestfit-crop']
    pack, B = sd['stages']['pack'], "resume_state_dict['stages']['pack']"
    buf = pack['buffer']
    assert len(buf['row']) >= 3
    reads = Reads(monkeypatch)
    def dup(cols, i, j): return {c: v[:j] + [v[i]] + v[j:] for c, v in cols.items()}
    entry = lambda i: (tuple(buf[c][i] for c in ('epoch', 'file', 'rg', 'row')), buf['offset'][i])
    metrics = lambda **kv: stages_with(sd, 'pack', metrics={**pack['metrics'], **kv})
    source = sd['stages']['source']
    cases = [
        (stages_with(sd, 'pack', buffer=dup(buf, 1, 3)), ValueError, re.escape(f"{B}['buffer']: entry 3 duplicates entry 1 ({entry(1)[0]}, offset 0)")),
        (stages_with(sd, 'pack', buffer={c: v * 600 for c, v in buf.items()}), ValueError,
         re.escape(f"{B}['buffer'] holds {600 * len(buf['row'])} documents: a loader with buffer_size=6 and "
                   "tokenizer_batch_size=4 holds at most 9")),
        (metrics(emitted=-5), ValueError, re.escape(f"{B}['metrics']['emitted']=-5 is invalid: expected an int >= 0")),
        (metrics(rows=2.0), ValueError, re.escape(f"{B}['metrics']['rows']=2.0 is invalid: expected an int >= 0")),
        (metrics(rows='2'), ValueError, re.escape(f"{B}['metrics']['rows']='2' is invalid")),
        (dict(sd, epoch=0), ValueError, re.escape("resume_state_dict['epoch']=0 is invalid: expected an int >= 1")),
        (dict(sd, epoch=sd['epoch'] + 1), ValueError, re.escape(f"resume_state_dict['epoch']={sd['epoch'] + 1} but "
                                                                "resume_state_dict['stages']['source']['last']['epoch']")),
        (dict(sd, config=[1]), TypeError, re.escape("resume_state_dict['config'] must be a dict, got list")),
        (dict(sd, pq_idx='x'), ValueError, re.escape("resume_state_dict['pq_idx']='x' is invalid: expected an int >= 0")),
        (stages_with(sd, 'source', cursor=5), TypeError, re.escape("resume_state_dict['stages']['source']['cursor'] must be a dict, got int")),
        (stages_with(sd, 'source', last=None), ValueError, re.escape("resume_state_dict has 'pq_idx', 'rg_idx', 'epoch', but "
                                                                     "resume_state_dict['stages']['source']['last'] is None")),
        (stages_with(sd, 'batch', step=True), ValueError, re.escape("resume_state_dict['stages']['batch']['step']=True is invalid")),
        (stages_with(sd, 'encode', ahead=[1]), ValueError, re.escape("resume_state_dict['stages']['encode'] has unknown keys ['ahead']")),
        ({**sd, 'stages': {k: v for k, v in sd['stages'].items() if k != 'transfer'}}, ValueError,
         re.escape("resume_state_dict['stages'] lacks ['transfer']")),
        (dict(sd, extra=1), ValueError, re.escape("resume_state_dict has unknown keys ['extra']")),
        ({k: v for k, v in sd.items() if k != 'format'}, ValueError, re.escape("resume_state_dict lacks 'format'")),
        ({k: v for k, v in sd.items() if k != 'rg_idx'}, ValueError, re.escape("resume_state_dict has 'pq_idx', 'epoch' but not 'rg_idx'")),
        (stages_with(sd, 'pack', buffer=dict(buf, row=[buf['row'][0] + 1000] + buf['row'][1:])), ValueError,
         re.escape(f"{B}['buffer']: entry 0 has row=")),
        (dict(sd, checksum='0' * 16), ValueError, re.escape("resume_state_dict['checksum'] does not match the state's contents")),
        (dict(sd, format='nanochat_dl.loader/2'), ValueError,
         re.escape("resume_state_dict has format 'nanochat_dl.loader/2', written by an earlier version of this loader, which reads "
                   "'nanochat_dl.loader/4' (the states of its stages: source, encode, pack, batch, transfer); to continue approximately, "
                   "as nanochat does, pass only the state's 'pq_idx', 'rg_idx' and 'epoch'")),
    ]
    assert source['last'] == {k: sd[k] for k in ('pq_idx', 'rg_idx', 'epoch')}
    for bad, kind, msg in cases:
        e = refused(env, bad)
        assert isinstance(e, kind) and re.search(msg, str(e)), (msg, repr(e))
    assert reads.n == 0, f"{reads.n} reads or encodings before refusing"


def test_a_state_of_format_2_is_refused_and_its_nanochat_fields_continue(env):
    "A state written by the previous version of the loader (format /2: reader, buffer, metrics and step at the top) is refused with the way to continue, which works."
    kw = dict(files=env['toy'], **TOYKW)
    with PackedLoader(env['tok'], **kw) as ld:
        sd = json.loads(json.dumps(list(itertools.islice(ld, 4))[-1].state))
    st = sd['stages']
    old = {'pq_idx': sd['pq_idx'], 'rg_idx': sd['rg_idx'], 'epoch': sd['epoch'], 'format': 'nanochat_dl.loader/2', 'step': st['batch']['step'],
           'config': sd['config'], 'fingerprint': sd['fingerprint'], 'reader': st['source']['cursor'], 'buffer': st['pack']['buffer'],
           'metrics': st['pack']['metrics'], 'checksum': '0' * 16}
    with pytest.raises(ValueError, match=re.escape("format 'nanochat_dl.loader/2', written by an earlier version")): PackedLoader(env['tok'], **kw, resume_state_dict=old)
    with PackedLoader(env['tok'], **kw, resume_state_dict={k: old[k] for k in ('pq_idx', 'rg_idx', 'epoch')}) as ld:
        assert ld.resumed == 'approximate' and next(ld).inputs.shape == (2, 24)


def test_nanochat_fields_too_large_for_a_state_are_refused(env):
    """nanochat's `{pq_idx, rg_idx, epoch}` with an epoch a state cannot hold (states keep epochs as int64s) is refused naming the
    field, not accepted to fail at the first batch; a huge `rg_idx` only moves on to the next file, as in nanochat."""
    kw = dict(files=env['toy'], **TOYKW)
    for e in (2 ** 62, 2 ** 63, 10 ** 30):
        with pytest.raises(ValueError, match=re.escape(f"resume_state_dict['epoch']={e} is invalid: expected an int >= 1 and < {2 ** 62}")):
            PackedLoader(env['tok'], **kw, resume_state_dict=dict(pq_idx=0, rg_idx=1, epoch=e))
    with PackedLoader(env['tok'], **kw, resume_state_dict=dict(pq_idx=0, rg_idx=1, epoch=2 ** 62 - 1)) as ld:
        assert next(ld).state['epoch'] == 2 ** 62 - 1
    with PackedLoader(env['tok'], **kw, resume_state_dict=dict(pq_idx=0, rg_idx=10 ** 30, epoch=1)) as ld:
        assert next(ld).state['pq_idx'] == 1

JSONS = st.recursive(st.none() | st.booleans() | st.integers(-3, 2 ** 64) | st.floats(allow_nan=False) | st.text(max_size=4),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3), max_leaves=6)


def _mutate(sd, data):
    "One random edit of a state: a value replaced, nudged or deleted, a key added, list items repeated or dropped, buffer entries duplicated, dropped, swapped or moved."
    sd = json.loads(json.dumps(sd))
    op = data.draw(st.sampled_from(['replace', 'nudge', 'delete', 'add', 'repeat', 'dup_entry', 'drop_entry', 'swap_entries', 'move_entry', 'grow']))
    buf = sd
    for k in ('stages', 'pack', 'buffer'): buf = buf.get(k) if isinstance(buf, dict) else None
    buf = buf if isinstance(buf, dict) else None
    cols = [c for c in ('epoch', 'file', 'rg', 'row', 'offset') if buf and isinstance(buf.get(c), list)]
    n = min((len(buf[c]) for c in cols), default=0) if cols else 0
    if op in ('dup_entry', 'drop_entry', 'swap_entries', 'move_entry', 'grow') and n:
        i, j = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n))
        for c in cols:
            v = buf[c]
            if op == 'dup_entry': v.insert(j, v[i])
            elif op == 'drop_entry': del v[i]
            elif op == 'swap_entries': v[i], v[min(j, n - 1)] = v[min(j, n - 1)], v[i]
            elif op == 'move_entry': v.insert(j, v.pop(i))
            else: buf[c] = v * data.draw(st.integers(2, 700))
        return sd
    path = data.draw(st.sampled_from(paths(sd)))
    if not path: return {} if op != 'replace' or (v := data.draw(JSONS)) is None else v     # (None would mean: no state at all)
    parent = sd
    for k in path[:-1]: parent = parent[k]
    k, v = path[-1], parent[path[-1]]
    if op == 'replace': parent[k] = data.draw(JSONS)
    elif op == 'nudge' and isinstance(v, int) and not isinstance(v, bool): parent[k] = v + data.draw(st.sampled_from([-2, -1, 1, 2, 7, 10 ** 6]))
    elif op == 'nudge' and isinstance(v, str): parent[k] = v[:-1] + ('0' if v[-1:] != '0' else '1')
    elif op == 'delete': del parent[k]
    elif op == 'add' and isinstance(v, dict): v[data.draw(st.text(max_size=6))] = data.draw(JSONS)
    elif op == 'repeat' and isinstance(v, list) and v: v.insert(data.draw(st.integers(0, len(v))), v[data.draw(st.integers(0, len(v) - 1))])
    return sd


FIELD = re.compile(r"resume_state_dict(\['\w+'\])?")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(strategy=st.sampled_from(['bestfit-crop', 'bestfit-split', 'concat']), data=st.data())
def test_mutated_states_are_refused_or_resume_exactly(env, runs, monkeypatch, strategy, data):
    """Any edit of a valid state (one to three of them, at any place) either is refused with a ValueError or TypeError
    that names a field of `resume_state_dict`, before any document is read or encoded, or resumes exactly."""
    full, sd = runs[strategy]
    bad = sd
    for _ in range(data.draw(st.integers(1, 3))): bad = _mutate(bad, data)
    with monkeypatch.context() as m:
        reads = Reads(m)
        try:
            ld = PackedLoader(env['tok'], files=env['toy'], pack=strategy, **TOYKW, resume_state_dict=json.loads(json.dumps(bad)))
        except (ValueError, TypeError) as e:
            assert 'resume_state_dict' in str(e), repr(e)
            assert reads.n == 0, f"{reads.n} reads or encodings before refusing: {e}"
            event('refused: ' + FIELD.match(str(e))[0])
            return
    event('resumed exactly' if bad == sd else 'edited, resumed exactly')
    with ld:
        for i, b in enumerate(itertools.islice(ld, len(full) - 9)):
            x0, y0, s0 = full[9 + i]
            assert torch.equal(b.inputs, x0) and torch.equal(b.targets, y0) and json.loads(json.dumps(b.state)) == s0


def test_every_field_replaced_by_a_value_of_another_kind_is_refused_naming_it(env, runs, monkeypatch):
    """The sweep behind the property test above, done exhaustively for one state: every field (and every list item) of a
    valid state replaced by each of a set of values of other kinds, or deleted. Each such state is refused with a
    ValueError or TypeError whose message starts with the field of `resume_state_dict` at fault, before reading a
    document (no other exception, no message without the field, no edit accepted)."""
    full, sd = runs['bestfit-crop']
    reads, wrong, accepted = Reads(monkeypatch), [], []
    for path in paths(sd)[1:]:
        for v in (None, 0, -1, True, 1.5, 'x', [], {}, [None], {'a': 1}, DELETE):
            if (bad := edited(sd, path, v)) is None: continue     # the same state (the field held that value)
            if path == ('config', 'max_wait') and v is DELETE: continue   # the form of a state from before max_wait: its default, the same
            n = reads.n
            try: PackedLoader(env['tok'], files=env['toy'], pack='bestfit-crop', **TOYKW, resume_state_dict=bad).close()
            except (ValueError, TypeError) as e:
                if not FIELD.match(str(e)) or reads.n > n: wrong.append((path, v, repr(e), reads.n - n))
            except Exception as e: wrong.append((path, v, repr(e)))
            else: accepted.append((path, v))
    assert not wrong, wrong[:5]
    assert not accepted, accepted[:5]       # the checksum refuses any edit that passes the other checks


# -- the tokenizer workers read their own rows ----------------------------------------------------------------------------

def _stream(tok, n, **kw):
    with PackedLoader(tok, **kw) as ld:
        return [(b.inputs.clone(), b.targets.clone(), json.loads(json.dumps(b.state))) for b in itertools.islice(ld, n)]


@pytest.mark.parametrize('strategy', ['bestfit-crop', 'bestfit-split', 'concat'])
def test_workers_reading_rows_give_the_batches_of_the_text_path(env, strategy):
    """Workers that read their own rows, workers sent text (the way it was), and threads: the same batches and the same
    states, on the sample shards (long documents, several epochs of the toy shards), from the start and after a resume."""
    for files, B, T, tbs, buf, n in ((split_files('train', env['data']), 4, 512, 32, 40, 25), (env['toy'], 3, 24, 4, 6, 30)):
        kw = dict(files=files, batch_size=B, seq_len=T, tokenizer_batch_size=tbs, pack_buffer=buf, pack=strategy, device='cpu', tokenizer_threads=2)
        reads = _stream(env['tok'], n, tokenize_in='processes', **kw)
        texts = _stream(env['tok'], n, tokenize_in='processes', worker_reads=False, **kw)
        threads = _stream(env['tok'], n, tokenize_in='threads', **kw)
        for other in (texts, threads):
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(reads, other))
        again = _stream(env['tok'], n - 10, tokenize_in='processes', resume_state_dict=texts[9][2], **kw)   # a state of the text path
        assert all(torch.equal(a[0], b[0]) and a[2] == b[2] for a, b in zip(again, reads[10:]))


def test_fastokens_gives_the_batches_of_tiktoken(env, monkeypatch):
    """Where fastokens is installed (the `fast-encode` extra) the loader encodes with it: the same batches and states
    as with tiktoken alone (NANOCHAT_DL_FAST_ENCODE=0), in worker processes and in threads, and a resume from one to
    the other."""
    pytest.importorskip('fastokens')
    from nanochat_dl.text._tokworker import FAST_ENV, fast_core
    kw = dict(files=split_files('train', env['data']), batch_size=4, seq_len=512, tokenizer_batch_size=32,
              pack_buffer=40, device='cpu', tokenizer_threads=2)
    for how in ('processes', 'threads'):
        monkeypatch.setenv(FAST_ENV, '0')
        assert fast_core(env['tok'].enc) is None
        plain = _stream(env['tok'], 20, tokenize_in=how, **kw)
        monkeypatch.setenv(FAST_ENV, '1')
        assert fast_core(env['tok'].enc) is not None
        fast = _stream(env['tok'], 20, tokenize_in=how, **kw)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(plain, fast))
        again = _stream(env['tok'], 10, tokenize_in=how, resume_state_dict=plain[9][2], **kw)
        assert all(torch.equal(a[0], b[0]) and a[2] == b[2] for a, b in zip(again, plain[10:]))
    monkeypatch.setenv('NANOCHAT_DL_DATA_DIR', str(env['data']))
    def dropin(fast):   # nanochat's loader, as a training script calls it
        monkeypatch.setenv(FAST_ENV, fast)
        dl = tokenizing_distributed_data_loader_with_state_bos_bestfit(env['tok'], 4, 512, 'train', device='cpu')
        try: return [(x.clone(), y.clone(), json.loads(json.dumps(s))) for x, y, s in itertools.islice(dl, 12)]
        finally: dl.close()
    plain, fast = dropin('0'), dropin('1')
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(plain, fast))

def test_no_text_is_read_in_the_training_process(env, monkeypatch):
    """With worker processes, the training process reads footers only: no row group is decoded and no text is sent, neither
    while streaming nor when a resume rebuilds the packing buffer (the workers fetch it)."""
    from nanochat_dl.text import encode, shards
    kw = dict(files=split_files('train', env['data']), batch_size=4, seq_len=512, tokenizer_batch_size=32, pack_buffer=40, device='cpu',
              tokenizer_threads=2, tokenize_in='processes')
    want = _stream(env['tok'], 14, **kw)
    calls = []
    for mod, name in ((shards, '_read_column'), (shards, 'read_documents'), (encode.ProcessEncoder, 'submit')):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    got = _stream(env['tok'], 6, resume_state_dict=want[7][2], **kw)
    assert all(torch.equal(a[0], b[0]) and a[2] == b[2] for a, b in zip(got, want[8:]))
    assert len(want[7][2]['stages']['pack']['buffer']['row']) > 10       # a buffer rebuilt by the workers
    assert calls == []


@pytest.mark.parametrize('tokenize_in,worker_reads', [('processes', True), ('processes', False), ('threads', True)])
def test_invalid_utf8_is_named_wherever_it_is_read(env, tmp_path, tokenize_in, worker_reads):
    "Raised in a tokenizer worker (or thread, or this process), the error names the file, row group and row, with the same message."
    import numpy as np, pyarrow as pa, pyarrow.parquet as pq
    p = tmp_path / 'shard_00000.parquet'
    raw_text_shard(p, [[b'one document', b'two documents'], [b'three', b'four \xf0\x28\x8c\x28 bad', b'five']])
    kw = dict(files=[p], device='cpu', tokenizer_threads=2, tokenize_in=tokenize_in, worker_reads=worker_reads, pack_buffer=2, tokenizer_batch_size=2)
    want = f"{p}: row group 1, row 1: 'text' is not valid UTF-8 (invalid continuation byte at byte 5: b'four \\xf0(\\x8c( bad'); pass utf8_errors='replace'"
    with PackedLoader(env['tok'], 1, 8, **kw) as ld:
        with pytest.raises(ValueError, match=re.escape(want)):
            for _ in range(20): next(ld)
    with PackedLoader(env['tok'], 1, 8, **kw, utf8_errors='replace') as ld:
        keys = {s.key[2:] for _ in range(20) for row in next(ld).segments for s in row}
    assert (1, 1) in keys                                                # the bad row, read with U+FFFD


def test_time_allowed_for_rows_counts_their_bytes_from_the_footer(env):
    "A message of rows to read is given `timeout[0] + timeout[1] * bytes` seconds, the bytes of text the footer gives for those rows."
    from nanochat_dl.text.encode import ProcessEncoder
    from nanochat_dl.text.stages import RowGroupSource
    src = RowGroupSource(RowGroupReader(split_files('train', env['data']), batch_size=16))
    slices = [next(src) for _ in range(6)]
    reqs = [src.request(s.file, s.rg, range(s.lo, s.hi)) for s in slices]
    rows = src.rows(slices[0].file, slices[0].rg)
    assert reqs[0].nbytes == -(-src.reader.text_bytes(0, 0) * 16 // rows) > 1000
    enc = ProcessEncoder(env['tok'], 1, timeout=(5.0, 1e-3))
    try:
        enc.submit_read(reqs)
        docs, amount, unit, _ = enc._w[0].pending[-1]
        assert (docs, amount, unit) == (96, sum(r.nbytes for r in reqs), 'bytes of text')
        assert enc._allowed(amount) == pytest.approx(5.0 + 1e-3 * amount)
        assert len(enc.result([0])) == 96
    finally: enc.close()


@pytest.mark.parametrize('worker_reads', [True, False])
def test_workers_with_file_descriptors_above_1023(env, worker_reads):
    """A training process that already holds over a thousand open files: the workers' pipes get descriptors above 1023
    (past select()'s FD_SETSIZE), and the processes give the batches of the threads."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) > 1024
        kw = dict(files=env['toy'], batch_size=2, seq_len=16, tokenizer_batch_size=2, pack_buffer=4, device='cpu', tokenizer_threads=2)
        procs = _stream(env['tok'], 12, tokenize_in='processes', worker_reads=worker_reads, **kw)
        threads = _stream(env['tok'], 12, tokenize_in='threads', **kw)
        assert len(procs) == len(threads) == 12
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(procs, threads))
    finally:
        for fd in held: os.close(fd)


@linux_only
@pytest.mark.timeout(120)
@pytest.mark.parametrize('prefetch', [0, 2])
def test_close_from_another_thread_with_busy_workers(env, monkeypatch, prefetch):
    """`close()` from another thread while the consumer waits in `next()` on workers that do not answer (stopped, with no
    time limit): the busy workers are killed without waiting the join timeout, and the consumer gets a clear error
    (never an `OSError` from pipes closed under it)."""
    import signal, threading
    from nanochat_dl.pipe import producer
    monkeypatch.setattr(producer, 'JOIN_TIMEOUT', 3600.0)   # a close that waits for the join timeout hangs the test
    ld = PackedLoader(env['tok'], 4, 256, files=split_files('train', env['data']), device='cpu', tokenizer_threads=2,
                      tokenize_in='processes', pack_buffer=20, prefetch=prefetch, worker_timeout=None)
    procs = list(ld.encoder._procs)
    for p in procs: os.kill(p.pid, signal.SIGSTOP)
    got = {}
    def consume():
        try:
            for _ in range(10_000): next(ld)
        except BaseException as e: got['error'] = e
    th = threading.Thread(target=consume, daemon=True); th.start()
    th.join(1.0)
    assert th.is_alive()                                   # waiting on the stopped workers
    ld.close()
    th.join(60)
    assert not th.is_alive()
    e = got['error']
    assert type(e) is RuntimeError and 'closed' in str(e), repr(e)
    assert all(p.poll() is not None for p in procs)
    assert ld._thread is None or not ld._thread.is_alive()
    with pytest.raises(RuntimeError, match='is closed'): next(ld)


@pytest.mark.parametrize('tokenize_in', ['threads', 'processes'])
def test_relative_shard_paths_survive_a_chdir(env, monkeypatch, tokenize_in):
    """Shards given by paths relative to the working directory, which the training script changes after building the
    loader (as logging or config code does): the loader still reads them, the batches of absolute paths."""
    kw = dict(batch_size=2, seq_len=16, tokenizer_batch_size=2, pack_buffer=4, device='cpu', tokenizer_threads=1, tokenize_in=tokenize_in)
    want = _stream(env['tok'], 200, files=env['toy'], **kw)   # several epochs: every shard opened again
    monkeypatch.chdir(env['toy'][0].parent)
    with PackedLoader(env['tok'], files=[Path(p.name) for p in env['toy']], **kw) as ld:
        take = lambda b: (b.inputs.clone(), b.targets.clone(), json.loads(json.dumps(b.state)))
        got = [take(next(ld))]
        monkeypatch.chdir(env['dir'])
        got += [take(next(ld)) for _ in range(199)]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(got, want))


@linux_only
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason='needs a machine with two CPUs or more')
def test_worker_count_follows_the_cpu_affinity(env):
    """Under an affinity mask of one CPU (taskset, Slurm's --cpus-per-task, cpusets), `make_encoder` starts one worker
    process, not one per CPU of the machine."""
    code = textwrap.dedent(f"""
        import os
        os.sched_setaffinity(0, {{sorted(os.sched_getaffinity(0))[0]}})
        from nanochat_dl.text.encode import make_encoder
        from nanochat_dl.text.tokenizer import Tokenizer
        e = make_encoder(Tokenizer.load({str(env['tok_dir'])!r}), 4, 'processes')
        print(e.workers); e.close()""")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['1']


def test_states_handed_out_are_copies(env):
    """A batch's `state` and `state_dict()` are the caller's own: changing one (adding a field before saving it, say)
    changes neither the loader's state nor the other."""
    with PackedLoader(env['tok'], 2, 16, files=env['toy'], device='cpu', tokenizer_threads=1, tokenize_in='threads', pack_buffer=4) as ld:
        start = json.dumps(ld.state_dict())
        ld.state_dict()['stages']['batch']['step'] = 99
        assert json.dumps(ld.state_dict()) == start
        b = next(ld); saved = json.dumps(b.state)
        assert json.dumps(ld.state_dict()) == saved
        b.state['stages']['batch']['step'] = 99; b.state['mine'] = 1
        assert json.dumps(ld.state_dict()) == saved
        sd = ld.state_dict(); sd['config']['B'] = 7
        assert json.dumps(ld.state_dict()) == saved and json.loads(saved)['config']['B'] == 2


@pytest.mark.parametrize('name', ['shuffle', 'copy', 'views', 'worker_reads'])
@pytest.mark.parametrize('value', ['no', 0, None])
def test_switches_must_be_bools(env, name, value):
    """A switch given a string, a number or None (`copy='no'` would be taken as True) is refused, naming it and the value,
    before any worker starts."""
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} is invalid: expected True or False")):
        PackedLoader(env['tok'], 2, 16, files=env['toy'], device='cpu', tokenizer_threads=1, **{name: value})


# One vocabulary (issue 20): the streaming loader's names, the old ones deprecated, the positional order nanochat's.
NEWKW = dict(batch_size=2, seq_len=24, pack='bestfit-pad', pack_buffer=5, pad_token=3)
OLDKW = dict(B=2, T=24, strategy='bestfit-pad', buffer_size=5, pad_id=3)
VKW = dict(tokenizer_batch_size=4, device='cpu', tokenizer_threads=1, tokenize_in='threads', prefetch=0)


@pytest.mark.parametrize('old,new', [('B', 'batch_size'), ('T', 'seq_len'), ('strategy', 'pack'), ('buffer_size', 'pack_buffer'),
                                     ('pad_id', 'pad_token')])
def test_an_old_keyword_still_works_and_warns(env, old, new):
    """Each old keyword gives the loader its new name gives, with a `DeprecationWarning` naming the new one; the state's
    config keys do not change."""
    with PackedLoader(env['tok'], files=env['toy'], **NEWKW, **VKW) as ld: want, first = ld.config, next(ld)
    kw = {k: v for k, v in NEWKW.items() if k != new}
    with pytest.warns(DeprecationWarning, match=rf"PackedLoader\({old}=\.\.\.\) is deprecated: use {new}=\.\.\."):
        ld = PackedLoader(env['tok'], files=env['toy'], **kw, **{old: OLDKW[old]}, **VKW)
    with ld:
        got = next(ld)
        assert ld.config == want and set(want) >= {'B', 'T', 'strategy', 'buffer_size', 'pad_id'}
        assert torch.equal(got.inputs, first.inputs) and got.state == first.state
    with pytest.raises(TypeError, match=f"got {old}=.* and {new}="):
        PackedLoader(env['tok'], files=env['toy'], **NEWKW, **{old: OLDKW[old]}, **VKW)


def test_positional_order_and_attributes(env):
    "`PackedLoader(tok, 2, 24)` is batch_size=2, seq_len=24; `B`/`T` and `batch_size`/`seq_len` are both there."
    with PackedLoader(env['tok'], 2, 24, files=env['toy'], **VKW) as ld:
        assert (ld.B, ld.T, ld.batch_size, ld.seq_len) == (2, 24, 2, 24) and next(ld).inputs.shape == (2, 24)
        assert ld.config['B'] == 2 and ld.config['T'] == 24 and ld.config['strategy'] == 'bestfit-crop'
    with pytest.raises(TypeError, match="missing required argument 'batch_size'"): PackedLoader(env['tok'], files=env['toy'])
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"): PackedLoader(env['tok'], 2, 24, bogus=1)


@pytest.mark.parametrize('pack,strategy', [('bestfit', 'bestfit-pad'), ('concat', 'concat'), ('bestfit-split', 'bestfit-split')])
def test_the_streaming_loaders_pack_names(env, pack, strategy):
    "A StreamingLoader pack name with the same rule is that strategy; its 'pad' (a document per row) is refused, naming what is accepted."
    with PackedLoader(env['tok'], 2, 24, files=env['toy'], pack=pack, **VKW) as a, \
         PackedLoader(env['tok'], 2, 24, files=env['toy'], pack=strategy, **VKW) as b:
        assert a.config == b.config and a.config['strategy'] == strategy
        assert all(torch.equal(next(a).inputs, next(b).inputs) for _ in range(5))
    with pytest.raises(ValueError, match=r"pack='pad'.*expected one of \['bestfit-crop'.*'bestfit' \(the same as 'bestfit-pad'\)"):
        PackedLoader(env['tok'], 2, 24, files=env['toy'], pack='pad', **VKW)
