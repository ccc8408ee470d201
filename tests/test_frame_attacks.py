"""Adversarial tests of the loaders' shared frame (`pipe.loader.BaseLoader`, chapter nbs/pipe/07c_loader) and of the
two loaders on it, `PackedLoader` (text) and `StreamingLoader` (tokens): close from another thread, twice, inside
iteration, or never (a drop); errors and interrupts in the producer; `state_dict` from another thread, before the
first batch, after close and after an error; resume at odd points; batches that belong to their caller; the end of
the data; threads and file descriptors left after close. Each test is small (a toy loader, a tiny token root, or
six toy shards with a tokenizer trained here) and bounded in time."""
import gc, os, pickle, threading, time, warnings
from types import SimpleNamespace

import pytest
import torch

from nanochat_dl.pipe import producer
from nanochat_dl.pipe.loader import BaseLoader
from nanochat_dl.pipe.state import seal
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.tokens import StreamingLoader
from test_streaming import toy_root
from toytext import toy_text_env

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"),
              pytest.mark.filterwarnings("ignore::ResourceWarning")]

KINDS, PREFETCH = ('packed', 'stream'), (0, 2)


@pytest.fixture(scope='module')
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp('attacks')
    text = toy_text_env(d / 'text', [[5, 3, 4], [2, 6, 1], [4, 4]])
    root = toy_root(d / 'root', {'web': {'a.arrow': 120, 'b.arrow': 60}, 'code': {'x.arrow': 40}})
    return SimpleNamespace(text=text, root=root)


def make(env, kind, **kw):
    "A small loader of `kind` ('packed' or 'stream') on the module's data, on the CPU."
    if kind == 'packed':
        kw = dict(dict(device='cpu', tokenizer_threads=1, tokenize_in='threads', pack_buffer=4), **kw)
        return PackedLoader(env.text['tok'], 2, 16, files=env.text['files'], **kw)
    return StreamingLoader(env.root, 32, 2, **kw)


def batches(ld, n): return (next(ld) for _ in range(n))
def rows(b): return (b.inputs.clone(), b.targets.clone())
def same(a, b): return all(torch.equal(x, y) for x, y in zip(a, b))
def fds() -> int: return len(os.listdir('/proc/self/fd'))
def ours() -> list: return [t for t in threading.enumerate() if t.name.startswith('nanochat_dl')]


def until(cond, timeout=5.0):
    "Whether `cond()` holds within `timeout` s."
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond(): return True
        time.sleep(0.01)
    return cond()


def slow_down(ld, kind, delay, fail_at=None, exc=None, after=0):
    """Make each batch of `ld` after the first `after` take `delay` s more (and the `fail_at`-th, counting from 1, raise
    `exc`), by wrapping what its `maker()` calls: `_Producer.produce` (text) or the stream's `next_rows` (tokens).
    Call it before the first batch (the maker is taken then)."""
    obj, name = (ld._producer, 'produce') if kind == 'packed' else (ld.stream, 'next_rows')
    real, n = getattr(obj, name), [0]
    def f(*a):
        n[0] += 1
        if n[0] > after: time.sleep(delay)
        if fail_at is not None and n[0] == fail_at: raise exc
        return real(*a)
    setattr(obj, name, f)
    return n


@pytest.fixture(autouse=True)
def no_warm_pool(monkeypatch):
    "Encode workers exit with their loader: a warm pool's kept workers (made by whichever test ran first) are not left."
    from nanochat_dl.text.procs import REUSE_ENV
    monkeypatch.setenv(REUSE_ENV, '0')


@pytest.fixture
def baseline():
    "Threads and descriptors before the test: after close, the loader has left none of its own."
    gc.collect()
    return SimpleNamespace(fds=fds(), threads=set(threading.enumerate()))


def left_nothing(base, timeout=5.0) -> bool:
    gc.collect()
    return until(lambda: not ours() and fds() <= base.fds, timeout)


# ---------------------------------------------------------------------------------------------------------------------
# A toy loader on the frame (as in 07c_loader), for what only the frame decides.

class Toy(BaseLoader):
    "Batches of `B` consecutive ints of `data` (`epochs` rounds, None: forever); a negative item raises `ValueError`."
    def __init__(self, data, B, prefetch=2, delay=0.0, epochs=None, kill=False):
        self.data, self.B, self.delay, self.epochs, self._pos = list(data), B, delay, epochs, 0
        src = self.src = SimpleNamespace(pos=0, raise_at=None, exc=None, calls=0, delay=delay)
        released, killed = self.released, self.killed = [], []
        self.open_frame(prefetch, lambda: released.append(True), (lambda: killed.append(True)) if kill else None)
    def maker(self):
        src, data, B, epochs = self.src, self.data, self.B, self.epochs
        def take():
            src.calls += 1
            time.sleep(src.delay)
            if src.raise_at is not None and src.calls == src.raise_at: raise src.exc
            if epochs is not None and src.pos + B > epochs * len(data): raise StopIteration
            out = [data[i % len(data)] for i in range(src.pos, src.pos + B)]
            if any(x < 0 for x in out): raise ValueError(f"bad item in {out}")
            src.pos += B
            return out, src.pos
        return take
    def deliver(self, item, t0, t1):
        batch, self._pos = item; self._state = None
        return SimpleNamespace(data=batch, metrics=dict(step=self._yielded))
    def state_body(self): return seal(dict(format='toy/2', pos=self._pos))
    def load_body(self, state): self.src.pos = self._pos = state['pos']; self._state = None


# ---------------------------------------------------------------------------------------------------------------------
# close: twice, inside iteration, from another thread, never (a drop)

@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_close_twice_and_inside_iteration(env, baseline, kind, pf):
    "close() in the loop's body ends the loop with 'closed' at the next batch; a second close() is a no-op."
    ld, got = make(env, kind, prefetch=pf), []
    with pytest.raises(RuntimeError, match='closed'):
        for b in ld:
            got.append(b)
            if len(got) == 3: ld.close(); ld.close()
    ld.close()
    assert len(got) == 3 and left_nothing(baseline)
    with pytest.raises(RuntimeError, match='closed'): next(ld)


@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_close_from_another_thread_while_next_runs(env, baseline, kind, pf):
    """close() from another thread while the caller's next() makes (prefetch=0) or waits for (prefetch=2) a slow batch:
    that next() says the loader was closed (not an error of the data), close() returns, nothing is left open."""
    ld = make(env, kind, prefetch=pf)
    slow_down(ld, kind, 0.3)
    next(ld)
    done = []
    t = threading.Timer(0.1, lambda: (ld.close(), done.append(time.monotonic())))
    got, t0 = [], time.monotonic()
    t.start()
    with pytest.raises(RuntimeError, match='closed'):
        for _ in range(100): got.append(next(ld))
    t.join(15)
    assert done and done[0] - t0 < 5 and not ld._error
    assert left_nothing(baseline)
    with pytest.raises(RuntimeError, match='closed'): next(ld)


@pytest.mark.parametrize('kind', KINDS)
def test_close_while_the_thread_is_blocked_in_a_slow_batch(env, baseline, kind):
    "prefetch=2, the thread inside a slow batch and the caller waiting for it: close() from another thread frees both."
    ld = make(env, kind, prefetch=2)
    slow_down(ld, kind, 0.5)
    next(ld)
    threading.Timer(0.2, ld.close).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match='closed'):
        for _ in range(20): next(ld)
    assert time.monotonic() - t0 < 5
    assert left_nothing(baseline)


@pytest.mark.parametrize('kind', KINDS)
def test_dropped_without_close_releases(env, baseline, kind):
    "A loader dropped unclosed, its thread running: collected, its thread stops and its files and workers are let go."
    ld = make(env, kind, prefetch=2, **({} if kind == 'stream' else dict(tokenize_in='processes')))
    for _ in range(3): next(ld)
    assert ours()
    del ld
    assert left_nothing(baseline)


def test_two_closes_at_once_release_once():
    "close() from two threads at the same time, a third thread inside next(): what the loader holds is let go once."
    for pf in PREFETCH:
        ld = Toy(range(50), 2, prefetch=pf, delay=0.05)
        next(ld)
        go = threading.Barrier(3)
        ts = [threading.Thread(target=lambda: (go.wait(), ld.close())) for _ in range(2)]
        caller = threading.Thread(target=lambda: (go.wait(), _swallow(lambda: [next(ld) for _ in range(100)])))
        for t in ts + [caller]: t.start()
        for t in ts + [caller]: t.join(15)
        assert ld.released == [True] and (ld._thread is None or not ld._thread.is_alive())


def _swallow(f):
    try: f()
    except RuntimeError as e: assert 'closed' in str(e)


# ---------------------------------------------------------------------------------------------------------------------
# errors in the producer: raised once, clearly; the loader then says it stopped, its state is the last batch's

class Boom(Exception): pass


@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_an_error_making_a_batch_reaches_the_caller_once(env, baseline, kind, pf):
    """The 3rd batch raises: next() raises that very error once, then says the loader stopped after it (naming it);
    the thread is gone, everything let go; state_dict() is still the 2nd batch's and resumes exactly."""
    with make(env, kind, prefetch=0) as ld: want = [rows(next(ld)) for _ in range(5)]
    ld = make(env, kind, prefetch=pf)
    slow_down(ld, kind, 0.0, fail_at=3, exc=Boom("tokenizer exploded"))
    b1, b2 = next(ld), next(ld)
    with pytest.raises(Boom, match='tokenizer exploded') as ei: next(ld)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"stopped after an error: Boom\('tokenizer exploded'\)"): next(ld)
    assert left_nothing(baseline)
    sd = ld.state_dict()
    assert sd == b2.state and ld.state_dict() == sd
    ld.close()
    with make(env, kind, prefetch=pf) as again:
        again.load_state_dict(sd)
        assert all(same(rows(next(again)), w) for w in want[2:])


@pytest.mark.parametrize('pf,tokenize_in', [(0, 'threads'), (2, 'threads'), (2, 'processes')])
def test_a_shard_corrupted_mid_run_is_named(env, tmp_path, baseline, pf, tokenize_in):
    "Shards overwritten with garbage after the first batch: next() raises an error naming one, then says it stopped."
    import shutil
    files = [shutil.copy(f, tmp_path / f.name) for f in env.text['files']]
    ld = PackedLoader(env.text['tok'], 2, 16, files=files, device='cpu', tokenizer_threads=1, tokenize_in=tokenize_in,
                      prefetch=pf, tokenizer_batch_size=1)
    next(ld)
    for f in files[1:]: open(f, 'r+b').write(b'\0garbage' * 64)
    with pytest.raises(Exception) as ei:
        for _ in range(200): next(ld)
    assert 'stopped after' not in str(ei.value) and any(str(f) in str(ei.value) for f in files[1:])
    with pytest.raises(RuntimeError, match='stopped after an error'): next(ld)
    assert left_nothing(baseline)


@pytest.mark.parametrize('pf', PREFETCH)
def test_keyboard_interrupt_in_the_producer(pf):
    "A KeyboardInterrupt making a batch reaches the caller as itself, once; the loader then says it stopped."
    ld = Toy(range(20), 2, prefetch=pf)
    ld.src.raise_at, ld.src.exc = 2, KeyboardInterrupt()
    next(ld)
    with pytest.raises(KeyboardInterrupt): next(ld)
    with pytest.raises(RuntimeError, match='stopped after an error: KeyboardInterrupt'): next(ld)
    assert ld.released == [True] and (ld._thread is None or not ld._thread.is_alive())
    assert ld.state_dict()['pos'] == 2


@pytest.mark.parametrize('kind', KINDS)
def test_keyboard_interrupt_in_a_real_producer_thread(env, baseline, kind):
    "The same in the streaming and the text loader's own thread."
    ld = make(env, kind, prefetch=2)
    slow_down(ld, kind, 0.0, fail_at=2, exc=KeyboardInterrupt())
    b1 = next(ld)
    with pytest.raises(KeyboardInterrupt): next(ld)
    with pytest.raises(RuntimeError, match='stopped after an error'): next(ld)
    assert ld.state_dict() == b1.state and left_nothing(baseline)


@pytest.mark.parametrize('pf', PREFETCH)
def test_the_end_of_the_data_ends_the_iteration_and_keeps_ending_it(pf):
    """A loader whose stages end (a finite source raises StopIteration) is an iterator that ends: `list(ld)` holds
    every batch, and next() keeps raising StopIteration after that (the iterator protocol), not an error."""
    ld = Toy(range(6), 2, prefetch=pf, epochs=2)
    assert [b.data for b in ld] == [[0, 1], [2, 3], [4, 5]] * 2
    for _ in range(3):
        with pytest.raises(StopIteration): next(ld)
    assert ld.released == [True] and (ld._thread is None or not ld._thread.is_alive())
    assert ld.state_dict()['pos'] == 12


@pytest.mark.parametrize('pf', PREFETCH)
def test_the_streams_end_is_said_as_this_ranks(env, pf):
    "The token stream's end (StopIteration) reaches the caller as 'no document with a token left', thread or not."
    ld = make(env, 'stream', prefetch=pf)
    slow_down(ld, 'stream', 0.0, fail_at=2, exc=StopIteration())
    next(ld)
    with pytest.raises(RuntimeError, match='no document with a token left'): next(ld)
    ld.close()


# ---------------------------------------------------------------------------------------------------------------------
# state_dict / load_state_dict: from another thread, before the first batch, after close, after the first batch

@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_state_dict_from_another_thread_is_always_a_handed_out_batchs(env, kind, pf):
    "state_dict() called over and over from another thread while the caller iterates: each is the start or a batch's."
    ld, seen, stop = make(env, kind, prefetch=pf), [], threading.Event()
    start = ld.state_dict()
    def watch():
        while not stop.is_set(): seen.append(pickle.dumps(ld.state_dict()))
    w = threading.Thread(target=watch); w.start()
    try: states = [pickle.dumps(next(ld).state) for _ in range(25)]
    finally: stop.set(); w.join(10); ld.close()
    ok = set(states) | {pickle.dumps(start)}
    assert seen and all(s in ok for s in seen)


@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_state_dict_before_the_first_batch_after_close_and_the_first_batch(env, kind, pf):
    """Before the first batch: the start (a loader resumed from it makes the same batches); after close(): the last
    batch's; load_state_dict after the first batch is refused and changes nothing."""
    with make(env, kind, prefetch=pf) as ld:
        start = ld.state_dict()
        want = [next(ld) for _ in range(4)]
        want_rows = [rows(b) for b in want]
        with pytest.raises(RuntimeError, match='before the first batch'): ld.load_state_dict(start)
        b5 = next(ld)                                # the refused load changed nothing
    assert ld.state_dict() == b5.state               # after close: the last batch's
    with make(env, kind, prefetch=0) as other:
        other.load_state_dict(want[3].state)
        assert same(rows(next(other)), rows(b5))
    with make(env, kind, prefetch=pf) as again:
        again.load_state_dict(start)
        assert all(same(rows(next(again)), w) for w in want_rows)


@pytest.mark.parametrize('kind', KINDS)
def test_resume_after_the_first_batch_and_again(env, kind):
    "Resumed after batch 1, then resumed again after its own batch 1: the batches of one uninterrupted run."
    with make(env, kind, prefetch=2) as ld: want = [rows(b) for b in (next(ld) for _ in range(5))]
    assert len({tuple(x.flatten().tolist()) for x, _ in want}) == 5   # (the batches differ: a skip would show)
    with make(env, kind, prefetch=2) as ld: s1 = next(ld).state
    with make(env, kind, prefetch=0) as ld:
        ld.load_state_dict(s1); b = next(ld); assert same(rows(b), want[1]); s2 = b.state
    with make(env, kind, prefetch=2) as ld:
        ld.load_state_dict(s2); assert all(same(rows(next(ld)), w) for w in want[2:])


@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_a_batch_and_a_state_belong_to_the_caller(env, kind, pf):
    """Editing a returned batch (its tensors, its state, its nested fields) or a returned state_dict() changes neither
    the loader's state nor later batches; a batch's state read late (after more batches, after close) is its own."""
    with make(env, kind, prefetch=0) as ld: want = [(rows(b), pickle.dumps(b.state)) for b in batches(ld, 5)]
    ld = make(env, kind, prefetch=pf)
    b1 = next(ld)
    b2 = next(ld)                                  # b2's state is not read before more batches are made
    sd = ld.state_dict(); sd_bytes = pickle.dumps(sd)
    b1.inputs.fill_(7); b1.targets.fill_(7)
    st = b1.state
    def scribble(x):
        if isinstance(x, dict):
            for k in list(x): x[k] = scribble(x[k])
        elif isinstance(x, list):
            for i in range(len(x)): x[i] = scribble(x[i])
        elif isinstance(x, int) and not isinstance(x, bool): return x + 1
        return x
    scribble(st); scribble(sd)
    assert pickle.dumps(ld.state_dict()) == sd_bytes == want[1][1]
    rest = [next(ld) for _ in range(3)]
    assert all(same(rows(b), w[0]) for b, w in zip(rest, want[2:]))
    assert pickle.dumps(b2.state) == want[1][1]
    ld.close()
    assert pickle.dumps(rest[-1].state) == want[4][1]


@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_state_dict_does_not_wait_for_a_slow_batch(env, kind, pf):
    """state_dict() from another thread (a checkpoint or watchdog thread) while the caller's next() waits for a slow
    batch returns the last batch's state at once; it does not wait for that batch to be made."""
    ld = make(env, kind, prefetch=pf)
    slow_down(ld, kind, 2.0, after=1)
    b1 = next(ld)
    want = pickle.dumps(b1.state)
    caller = threading.Thread(target=lambda: _swallow(lambda: next(ld))); caller.start()
    time.sleep(0.2)
    t0 = time.monotonic(); got = ld.state_dict(); dt = time.monotonic() - t0
    caller.join(10); ld.close()
    assert pickle.dumps(got) == want and dt < 0.5, f"state_dict() took {dt:.2f} s"


@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_an_error_handing_out_a_batch_skips_nothing(env, kind, pf):
    """The hand-off of batch 3 fails (the transfer to the device raises: out of memory, a KeyboardInterrupt landing in
    it): the loader must not go on as if it had been handed out. Either next() stops (says it stopped after the error)
    or it hands out batch 3 again; it never hands out batch 4 as the next batch, so a run that goes on skips nothing."""
    with make(env, kind, prefetch=0) as ld: want = [rows(b) for b in (next(ld) for _ in range(5))]
    ld = make(env, kind, prefetch=pf)
    b1, b2 = next(ld), next(ld)
    real, n = ld.transfer.put, [0]
    def put(x):
        n[0] += 1
        if n[0] == 1: raise Boom("CUDA out of memory")
        return real(x)
    ld.transfer.put = put
    with pytest.raises(Boom): next(ld)
    assert ld.state_dict() == b2.state
    try: b = next(ld)
    except RuntimeError as e: assert 'stopped after an error' in str(e)
    else: assert same(rows(b), want[2]), "batch 3 was skipped: the next batch is batch 4"
    finally: ld.close()


def test_a_next_outliving_close_lets_go_as_it_returns(monkeypatch):
    """prefetch=0, a batch slower than close()'s wait: close() warns and returns; the next() still making the batch
    says the loader was closed, and lets go of what the loader holds as it returns (once)."""
    monkeypatch.setattr(producer, 'JOIN_TIMEOUT', 0.2)
    ld = Toy(range(20), 2, prefetch=0, delay=0.6)
    out = []
    t = threading.Thread(target=lambda: _swallow(lambda: out.append(next(ld)))); t.start()
    time.sleep(0.1)
    with pytest.warns(UserWarning, match='did not return in time'): ld.close()
    assert ld.released == []                                  # the batch is still being made on the stages
    t.join(5)
    assert out == [] and ld.released == [True]
    with pytest.raises(RuntimeError, match='closed'): next(ld)
    assert ld.released == [True]


def test_a_thread_outliving_close_still_lets_go_when_it_ends(monkeypatch):
    """prefetch=2, the thread inside a batch slower than close()'s wait: close() warns and keeps open what the thread
    uses (it must not be released under it); once that thread ends, what the loader held is released: nothing leaks."""
    monkeypatch.setattr(producer, 'JOIN_TIMEOUT', 0.2)
    ld = Toy(range(20), 2, prefetch=2, delay=0.6)
    next(ld)                                                   # the thread goes on to batch 2: 0.6 s
    with pytest.warns(UserWarning, match='did not stop'): ld.close()
    assert ld.released == []
    assert until(lambda: not ld._thread.is_alive(), 5)
    assert until(lambda: ld.released == [True], 2), "the thread ended, but what the loader holds was never released"


def test_a_streaming_thread_outliving_close_unmaps_when_it_ends(env, baseline, monkeypatch):
    "The same for the streaming loader: its root's files stay mapped while the thread runs, and are unmapped after."
    monkeypatch.setattr(producer, 'JOIN_TIMEOUT', 0.2)
    ld = make(env, 'stream', prefetch=2)
    slow_down(ld, 'stream', 0.6, after=1)
    next(ld)
    time.sleep(0.1)
    with pytest.warns(UserWarning, match='did not stop'): ld.close()
    assert ld.root.users == 1
    assert until(lambda: not ld._thread.is_alive(), 5)
    assert until(lambda: ld.root.users == 0, 2) and left_nothing(baseline), "the root stays held and mapped for good"


def test_closed_while_it_made_a_batch_keeps_the_cause_and_not_the_error():
    """prefetch=0: close() from another thread while next() makes a batch, and the batch fails because of it (a worker
    killed): next() says the loader was closed, with the batch's error as its cause (for whoever debugs it); the error
    is not kept as the data's (the next next() says closed, not 'stopped after an error')."""
    ld = Toy(range(20), 2, prefetch=0, delay=0.3)
    ld.src.raise_at, ld.src.exc = 1, Boom("worker killed")
    threading.Timer(0.1, ld.close).start()
    with pytest.raises(RuntimeError, match='closed while it made a batch') as ei: next(ld)
    with pytest.raises(RuntimeError, match='is closed'): next(ld)
    assert ld._error is None and ld.released == [True]
    assert isinstance(ei.value.__cause__, Boom)


@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_two_threads_taking_batches_lose_and_repeat_none(env, kind, pf):
    "Two threads calling next() on one loader: together they get the batches of one run, each once, with its state."
    with make(env, kind, prefetch=0) as ld: want = [(rows(b), pickle.dumps(b.state)) for b in batches(ld, 20)]
    ld, got = make(env, kind, prefetch=pf), []
    def take():
        for _ in range(10):
            b = next(ld); got.append((rows(b), pickle.dumps(b.state)))
    ts = [threading.Thread(target=take) for _ in range(2)]
    for t in ts: t.start()
    for t in ts: t.join(30)
    ld.close()
    key = lambda x: x[1]
    assert sorted(map(key, got)) == sorted(map(key, want))
    by_state = {s: r for r, s in want}
    assert all(same(r, by_state[s]) for r, s in got)


def test_a_text_loader_with_tokenizing_threads_waits_for_its_batch_on_close(env, baseline):
    """A text loader tokenizing in threads (no workers to kill), prefetch=0, a batch that takes longer than the grace of
    a loader with workers: close() from another thread waits for that batch, then lets go of everything, without a
    warning; next() says the loader was closed."""
    ld = make(env, 'packed', prefetch=0)
    assert getattr(ld.encoder, 'kill', None) is None
    slow_down(ld, 'packed', 1.5, after=1)
    next(ld)
    res = []
    def close():
        t0 = time.monotonic(); ld.close(); res.append(time.monotonic() - t0)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        t = threading.Timer(0.2, close); t.start()
        with pytest.raises(RuntimeError, match='closed while it made a batch'): next(ld)
        t.join(15)
    assert res and 1.0 < res[0] < 5 and left_nothing(baseline)


@pytest.mark.parametrize('kind', KINDS)
def test_load_state_dict_twice_and_a_refused_one_before_the_first_batch(env, kind):
    """Before the first batch: a loaded state is what state_dict() says; a second load wins; a state refused (its
    checksum edited) leaves the loader as it was."""
    with make(env, kind, prefetch=2) as ld:
        start = ld.state_dict()
        s = [next(ld).state for _ in range(4)]
        want = [rows(next(ld)) for _ in range(2)]
    with make(env, kind, prefetch=2) as ld:
        ld.load_state_dict(s[0]); assert ld.state_dict() == s[0]
        ld.load_state_dict(s[3]); assert ld.state_dict() == s[3]
        bad = dict(s[1], checksum=('0' if s[1]['checksum'][0] != '0' else '1') + s[1]['checksum'][1:])
        with pytest.raises(ValueError, match='checksum'): ld.load_state_dict(bad)
        assert ld.state_dict() == s[3]
        assert all(same(rows(next(ld)), w) for w in want)
    with make(env, kind, prefetch=0) as ld:
        with pytest.raises(ValueError, match='checksum'): ld.load_state_dict(bad)
        assert ld.state_dict() == start


@pytest.mark.parametrize('pf', PREFETCH)
@pytest.mark.parametrize('kind', KINDS)
def test_close_in_a_signal_handler_during_next(env, baseline, kind, pf):
    """close() from a signal handler that interrupts the caller's own next() (making or waiting for a slow batch): that
    next() says the loader was closed and lets go as it returns; nothing is left open."""
    import signal
    ld = make(env, kind, prefetch=pf)
    slow_down(ld, kind, 0.5, after=1)
    next(ld)
    old = signal.signal(signal.SIGALRM, lambda *a: ld.close())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(RuntimeError, match='closed'):
            for _ in range(5): next(ld)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0); signal.signal(signal.SIGALRM, old)
    assert left_nothing(baseline)


def test_closed_streaming_loader_leaves_no_file_mapped(env, baseline):
    "After close(), no token file of the root is mapped, though batches are kept and their segments and metrics read."
    maps = lambda: [l for l in open('/proc/self/maps') if str(env.root) in l]
    ld = make(env, 'stream', prefetch=2)
    bs = [next(ld) for _ in range(5)]
    assert maps()
    ld.close(); gc.collect()
    assert not maps()
    assert [b.segments for b in bs] and [b.metrics['step'] for b in bs] == [1, 2, 3, 4, 5]
    gc.collect()
    assert not maps() and left_nothing(baseline)


def test_a_loader_collected_on_its_own_thread(env, baseline):
    """A streaming loader in a reference cycle, dropped: the cyclic GC may collect it on its producer thread (here it
    does, inside a batch). The release runs there (it cannot join itself): the thread stops, the root is let go."""
    ld = make(env, 'stream', prefetch=2)
    root, seen = ld.root, []
    real, n = ld.stream.next_rows, [0]
    def rows_then_collect(B):
        n[0] += 1
        if n[0] == 4:
            time.sleep(0.3); gc.collect(); seen.append((threading.current_thread().name, root.users))
        return real(B)
    ld.stream.next_rows = rows_then_collect
    gc.disable()                                     # (only the producer's gc.collect() collects it)
    try:
        next(ld)
        ld.cycle = ld
        del ld
        assert until(lambda: bool(seen), 5) and seen[0] == ('nanochat_dl-stream', 0)
    finally: gc.enable()
    assert left_nothing(baseline)


@pytest.mark.parametrize('kill', [False, True])
def test_close_interrupted_by_ctrl_c_still_lets_go(kill):
    """close() interrupted (Ctrl-C: a KeyboardInterrupt from a signal handler) while it waits for the thread to finish a
    slow batch: the KeyboardInterrupt reaches the caller, and what the loader holds is still let go once the thread
    stops (not never: the loader is marked closed, so a second close() does nothing)."""
    import signal
    ld = Toy(range(20), 2, prefetch=2, delay=0.8, kill=kill)
    next(ld)                                                   # the thread goes on to batch 2: 0.8 s
    def interrupt(*a): raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt): ld.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0); signal.signal(signal.SIGALRM, old)
    ld.close()
    assert until(lambda: not ld._thread.is_alive(), 5)
    assert until(lambda: ld.released == [True], 2), "the thread stopped, but what the loader holds was never released"


@pytest.mark.parametrize('pf', PREFETCH)
def test_closing_one_of_two_loaders_on_a_root_leaves_the_other_reading(env, baseline, pf):
    """Two streaming loaders share one `TokenRoot`, each iterated in its own thread; the first is closed from a third
    thread mid-run: the second reads on, its batches those of a loader alone; the root is let go when both are closed."""
    from nanochat_dl.tokens import TokenRoot
    with make(env, 'stream', prefetch=0, seed=1) as ld: want = [rows(b) for b in batches(ld, 30)]
    tr = TokenRoot(env.root)
    a, b = StreamingLoader(tr, 32, 2, prefetch=pf), StreamingLoader(tr, 32, 2, prefetch=pf, seed=1)
    slow_down(a, 'stream', 0.01); slow_down(b, 'stream', 0.01)
    got, err = [], []
    def run_a():
        try:
            for _ in range(1000): next(a)
        except RuntimeError as e: err.append(str(e))
    ta, tb = threading.Thread(target=run_a), threading.Thread(target=lambda: got.extend(rows(x) for x in batches(b, 30)))
    ta.start(); tb.start()
    time.sleep(0.1); a.close()
    ta.join(10); tb.join(30)
    assert len(err) == 1 and 'closed' in err[0] and tr.users == 1
    assert len(got) == 30 and all(same(x, y) for x, y in zip(got, want))
    b.close()
    assert tr.users == 0 and left_nothing(baseline)
