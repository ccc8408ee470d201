"""Adversarial attacks on object storage (issue 19 §4), against moto on 127.0.0.1 behind the fault proxy: a cache
index damaged by hand, `close()` of one of two loaders sharing a root behind a stalled request, loaders opened
and closed in a loop (threads and descriptors counted). Every wait is bounded."""
import itertools, json, os, re, subprocess, sys, threading, time, warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from s3util import moto, proxy, use_proxy   # noqa: F401 (fixtures)
from test_s3_loaders import KW, objects, token_root

from nanochat_dl.tokens.root import TokenRoot
from nanochat_dl.io.cache import FileCache
from nanochat_dl.tokens import StreamingLoader

pytest.importorskip('moto')
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
FAST = dict(backoff=0.01, max_backoff=0.05, timeout=5)
SLOW = dict(backoff=0.01, max_backoff=0.05)        # a request may stall for the default 30 s


def until(cond, timeout=60.0, what='condition'):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond(): return
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached in {timeout}s")


@pytest.fixture
def bucket(moto, proxy, monkeypatch, request): return use_proxy(proxy, monkeypatch, request)


# ---- a cache index damaged by hand ------------------------------------------------------------------------

def _damaged(good):
    d = json.loads(good)
    return {'truncated': good[:len(good) // 2], 'empty': '', 'a list': '[]', 'files a string': json.dumps(dict(d, files='x')),
            'files missing one': json.dumps(dict(d, files=d['files'][:1])),      # the stamp still matches the store
            'a size a string': json.dumps(dict(d, files=[[r, str(s)] for r, s in d['files']])),
            'mtimes a list': json.dumps(dict(d, mtimes=[1]))}


@pytest.mark.parametrize('how', list(_damaged(json.dumps({'files': [['a', 1]]}))))
def test_a_damaged_index_is_listed_again(moto, bucket, tmp_path, how):
    "A cache index truncated or edited by hand (wrong types, a file left out while the stamp still matches) is not trusted: the root is listed again with a warning naming the index, every file of the store is there, and no copy is kept unchecked (a same-size copy of other bytes is fetched again)."
    moto.put(bucket, {'d/a.bin': b'a' * 10, 'd/b.bin': b'b' * 20})
    uri, c = f's3://{bucket}/d', tmp_path/'c'
    with FileCache(uri, c) as fc: fc.local('a.bin'); fc.local('b.bin')
    (c/'files'/'b.bin').write_bytes(b'X' * 20)                                        # a copy the damaged index cannot vouch for
    good = (c/'index.json').read_text()
    (c/'index.json').write_text(_damaged(good)[how])
    with pytest.warns(UserWarning, match=re.escape(str(c/'index.json'))):
        fc = FileCache(uri, c)
    with fc:
        assert fc.files == {'a.bin': 10, 'b.bin': 20}
        assert fc.local('b.bin').read_bytes() == b'b' * 20 and fc.local('a.bin').read_bytes() == b'a' * 10
    assert json.loads((c/'index.json').read_text())['files'] == [['a.bin', 10], ['b.bin', 20]]
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        FileCache(uri, c).close()                                                     # the rewritten index: trusted again


# ---- close() of one of two loaders sharing a root, behind a stalled request ---------------------------------

@pytest.mark.parametrize('prefetch', [0, 2])
def test_close_of_one_of_two_loaders_on_a_root_is_bounded_behind_a_stall(moto, proxy, bucket, tmp_path, prefetch):
    "Two loaders share one `TokenRoot`; every token file's GET stalls; `close()` of the first, whose `next()` waits in another thread, returns within about a second (not the 10 s it waits for a `next()`), that `next()` says the loader was closed, and the second loader, once the store answers again, reads on; its close unmaps the root."
    local = token_root(tmp_path/'root')
    moto.put(bucket, objects(local, 'tokens'))
    want = [b.rows.copy() for b in itertools.islice(StreamingLoader(local, **KW), 5)]
    tr = TokenRoot(f's3://{bucket}/tokens', cache_dir=tmp_path/'c', fetch=SLOW)
    proxy.add('stall', path='.arrow', count=10_000, after=100)
    a, b = StreamingLoader(tr, **dict(KW, prefetch=prefetch)), StreamingLoader(tr, **KW)
    err = []
    def take():
        try: next(a)
        except BaseException as e: err.append(e)
    t = threading.Thread(target=take, daemon=True); t.start()
    until(lambda: 'stall' in proxy.requests('.arrow'), what='a stalled GET')
    time.sleep(0.3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        t0 = time.monotonic(); a.close(); dt = time.monotonic() - t0
    t.join(5)
    assert dt < 2.0, f"close() took {dt:.1f} s ({[str(x.message) for x in w]})"
    assert not t.is_alive() and len(err) == 1 and 'this loader was closed' in str(err[0]), err
    assert tr.users == 1
    proxy.faults.clear(); proxy.release()
    got = [x.rows.copy() for x in itertools.islice(b, 5)]
    assert all(np.array_equal(x, y) for x, y in zip(got, want)) and len(got) == 5
    b.close()
    assert tr.users == 0 and not tr._open and tr.cache.closed


# ---- close() from a signal handler, and from many threads at once --------------------------------------------

SIGNAL_CLOSE = r'''
import signal, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from test_s3_loaders import KW, token_root
from nanochat_dl.tokens import StreamingLoader
local = token_root(Path(sys.argv[2]), {'web': {f'{i}.arrow': 300 for i in range(10)}})
late = mapped = users = 0; errors = set()
for trial in range(20):
    ld = StreamingLoader(local, **dict(KW, prefetch=0, batch_size=256, seq_len=2048))
    at = []
    def handler(*a): at.append(time.perf_counter()); ld.close()
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.002 + 0.003 * (trial % 7))
    try:
        while True:
            t0 = time.perf_counter(); next(ld)
            if at and at[0] > t0: late += 1                      # a batch made while the handler closed the loader
    except RuntimeError as e: errors.add(str(e))
    signal.setitimer(signal.ITIMER_REAL, 0)
    mapped += bool(ld.root._open); users += ld.root.users
print('RESULT', late, mapped, users, sorted(errors))
'''


def test_close_from_a_signal_handler_during_next(tmp_path):
    "`close()` in a signal handler that interrupts `next()` (prefetch 0, the main thread): that `next()` hands out no batch but says the loader was closed, and once it has returned no file stays mapped and the root has no user (before, the batch came out and the production mapped the files again after close)."
    r = subprocess.run([sys.executable, '-c', SIGNAL_CLOSE, str(Path(__file__).parent), str(tmp_path/'root')],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    line = next((l for l in r.stdout.splitlines() if l.startswith('RESULT')), None)
    assert r.returncode == 0 and line, r.stderr[-3000:]
    late, mapped, users, errors = eval(line.split(' ', 1)[1].replace(' ', ',', 3))
    assert (late, mapped, users) == (0, 0, 0), line
    assert set(errors) <= {'this loader was closed while it made a batch', 'this loader is closed'}, errors


def test_close_from_many_threads_at_once_releases_the_root_once(tmp_path):
    "Eight threads close one of three loaders sharing a root at the same moment, 100 times over: the root loses exactly one user each time (a double release would unmap the others' files)."
    local = token_root(tmp_path/'root', {'web': {'a.arrow': 50}})
    old = sys.getswitchinterval(); sys.setswitchinterval(1e-6)
    try:
        with TokenRoot(local) as tr:
            keep = [StreamingLoader(tr, **KW) for _ in range(2)]
            for _ in range(100):
                ld = StreamingLoader(tr, **KW); go = threading.Barrier(8)
                def shut(): go.wait(5); ld.close()
                ts = [threading.Thread(target=shut) for _ in range(8)]
                for t in ts: t.start()
                for t in ts: t.join(30)
                assert tr.users == 2, tr.users
            for k in keep: k.close()
            assert tr.users == 0
    finally: sys.setswitchinterval(old)


# ---- the README test skips nothing silently ---------------------------------------------------------------------

FENCE = re.compile(r'^```([^\n`]*)\n(.*?)^```[ \t]*$', re.M | re.S)


def unrun(text) -> list:
    "What `test_readme` would pass over in README `text` without a word: a fenced block tagged other than sh/python (untagged: printed output), a check or given keyed by a line no runnable block holds (or that two hold)."
    from test_readme import CHECKS, GIVEN, readme_blocks
    out = [f"a ```{tag} block: {code.strip().splitlines()[0][:60] if code.strip() else ''}" for tag, code in FENCE.findall(text)
           if tag.strip() not in ('sh', 'python', '')]
    codes = [code for _, code in readme_blocks(text)]
    out += [f"{key!r} is in {n} blocks" for key in list(CHECKS) + list(GIVEN) if (n := sum(key in c for c in codes)) != 1]
    return out


def test_the_readme_test_passes_over_nothing():
    "Every fenced block of README.md is run by `test_readme` (or is output), and every check it makes finds its block; a block tagged ```bash, or a checked line reworded, is caught here (it would be skipped there)."
    text = (Path(__file__).parents[1]/'README.md').read_text()
    assert unrun(text) == []
    assert unrun(text.replace('```sh\nnanochat-dl tokenize', '```bash\nnanochat-dl tokenize', 1)) == [
        'a ```bash block: nanochat-dl tokenize --data-dir ~/.cache/nanochat_dl/base_da']
    assert unrun(text.replace('batch = next(loader)', 'b = next(loader)', 1)) == ["'batch = next(loader)' is in 0 blocks"]


# ---- revalidation on open, under a stalled or changing store ------------------------------------------------------

def test_a_stalled_listing_on_open_falls_back_to_the_cached_one_in_bounded_time(moto, proxy, bucket, tmp_path):
    "With everything cached, the LIST that revalidates the listing on open stalls: the open gives up within its tries of `timeout` s each and streams the cached data exactly (as offline), fetching nothing."
    local = token_root(tmp_path/'root')
    moto.put(bucket, objects(local, 'tokens'))
    uri, c = f's3://{bucket}/tokens', tmp_path/'c'
    want = [b.rows.copy() for b in itertools.islice(StreamingLoader(local, **KW), 60)]
    with StreamingLoader(uri, **KW, cache_dir=c) as ld: [b for b in itertools.islice(ld, 60)]
    proxy.add('stall', path='list-type', count=100, after=0)
    t0 = time.monotonic()
    tr = TokenRoot(uri, cache_dir=c, fetch=dict(FAST, timeout=2))
    dt = time.monotonic() - t0
    assert 'stall' in proxy.requests('list-type') and dt < 15, dt
    with StreamingLoader(tr, **KW) as ld: got = [b.rows.copy() for b in itertools.islice(ld, 60)]
    assert all(np.array_equal(a, b) for a, b in zip(got, want)) and tr.cache.stats()['fetched_bytes'] == 0
    proxy.release()


def test_an_object_replaced_mid_download_is_never_pieced_together(moto, proxy, bucket, tmp_path):
    "No manifest (no sha256): an object is replaced, at the same size, while its download stalls between two ranged GETs; the retry must not append the new object's tail to the old one's head (a copy of neither version, which no check would catch later)."
    old, new = bytes(range(256)) * 12, bytes(255 - (i % 256) for i in range(3072))
    moto.put(bucket, {'d/a.bin': old, 'd/z.bin': b'z'})
    with FileCache(f's3://{bucket}/d', tmp_path/'c', chunk_size=1024, prefetch=0, **FAST) as fc:
        proxy.add('stall', path='a.bin', count=1, after=0, skip=1)                 # the second ranged GET stalls
        got = []
        t = threading.Thread(target=lambda: got.append(fc.local('a.bin').read_bytes()), daemon=True); t.start()
        until(lambda: 'stall' in proxy.requests('a.bin'), 30, 'a stalled GET')
        moto.put(bucket, {'d/a.bin': new})                                         # re-uploaded meanwhile
        proxy.release(); t.join(60)
        assert not t.is_alive() and got and got[0] in (old, new), (got[0][:4], got[0][1020:1028]) if got else got


PACKED_SIGNAL_CLOSE = r'''
import signal, sys, tempfile, time
from pathlib import Path
from nanochat_dl.text.sample import make_sample_shards
from nanochat_dl.text.tokenizer import train_tokenizer
from nanochat_dl.text.loader import PackedLoader
d = Path(sys.argv[1]); make_sample_shards(d/'sample')
tok = train_tokenizer(d/'sample', vocab_size=512, out_dir=d/'tok', progress=False)
late = 0; errors = set()
for trial in range(6):
    ld = PackedLoader(tok, 64, 1024, data_dir=d/'sample', device='cpu', prefetch=0, tokenizer_threads=2, tokenize_in=sys.argv[2])
    at = []
    def handler(*a): at.append(time.perf_counter()); ld.close()
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.01 + 0.01 * trial)
    try:
        while True:
            t0 = time.perf_counter(); next(ld)
            if at and at[0] > t0: late += 1
    except RuntimeError as e: errors.add(str(e))
    signal.setitimer(signal.ITIMER_REAL, 0)
print('RESULT', late, sorted(errors))
'''


@pytest.mark.parametrize('tokenize_in', ['threads', 'processes'])
def test_packed_loader_close_from_a_signal_handler_during_next(tmp_path, tokenize_in):
    "`PackedLoader.close()` in a signal handler interrupting `next()` (prefetch 0): the process neither hangs (before, with tokenizer threads, the handler's close waited for ever on the executor lock that the interrupted `submit` held) nor hands out that batch; the `next()` says the loader was closed."
    r = subprocess.run([sys.executable, '-c', PACKED_SIGNAL_CLOSE, str(tmp_path), tokenize_in], capture_output=True, text=True,
                       timeout=240, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    line = next((l for l in r.stdout.splitlines() if l.startswith('RESULT')), None)
    assert r.returncode == 0 and line, r.stderr[-3000:]
    late, errors = line.split(' ', 2)[1:]
    assert late == '0' and set(eval(errors)) <= {'this loader was closed while it made a batch', 'this loader is closed'}, line
