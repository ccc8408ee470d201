"""nanochat_dl.io (the file cache) against a real S3-compatible server (moto, a child process on 127.0.0.1) behind a
fault-injecting proxy: fetch and verify, cache hits, background prefetch, 5xx/SlowDown, resets,
truncated and stalled bodies, a server killed and restarted, objects replaced, eviction under a cap,
offline restarts, two processes sharing one cache folder, and a process killed mid-download."""
import hashlib, os, re, signal, subprocess, sys, threading, time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from s3util import FaultProxy, MotoServer, moto, proxy, s3_env, until, use_proxy, wait_port   # noqa: F401 (moto, proxy: fixtures)

from nanochat_dl.io.cachedir import Flock
from nanochat_dl.io.retries import FetchError, is_transient
from nanochat_dl.io.cache import FileCache
from nanochat_dl.io.uri import RemoteFile, list_files, open_uri

pytest.importorskip('moto')
FAST = dict(backoff=0.01, max_backoff=0.05, timeout=5)
NAMES = [f'part_{i:03d}.bin' for i in range(8)]


def sha(b): return hashlib.sha256(b).hexdigest()


def blobs(n=8, size=200_000, seed=0):
    "`n` objects of distinct sizes and random bytes."
    import random
    r = random.Random(seed)
    return {f'data/{NAMES[i]}': r.randbytes(size + 1000 * i) for i in range(n)}



def finished(cache_dir):
    """Finished copies in a cache folder: {relpath: bytes}. Taken under the folder's lock, which every eviction holds, so a
    prefetch running meanwhile cannot remove a copy between the listing and its reading (it may only add one, within the
    room it reserved)."""
    top = Path(cache_dir)/'files'
    with Flock(Path(cache_dir)/'.lock'):
        return {p.relative_to(top).as_posix(): p.read_bytes() for p in sorted(top.rglob('*')) if p.is_file()}


def temps(cache_dir): return sorted(p.name for p in (Path(cache_dir)/'.tmp').iterdir())


@pytest.fixture
def s3(moto, proxy, monkeypatch, request):
    "A fresh bucket holding `blobs()` under `data/`; the environment points at the proxy. Returns (root URI, {rel: bytes})."
    bucket = use_proxy(proxy, monkeypatch, request)
    objs = blobs()
    moto.put(bucket, objs)
    return f's3://{bucket}/data', {k.removeprefix('data/'): v for k, v in objs.items()}


# ---- URIs and listings ------------------------------------------------------------------------------

def test_open_uri_forms(tmp_path, monkeypatch):
    for k, v in s3_env('http://127.0.0.1:9').items(): monkeypatch.setenv(k, v)   # full settings: the SDK looks nowhere else
    fs, p = open_uri(tmp_path)
    assert (fs.type_name, p) == ('local', tmp_path.as_posix())
    assert open_uri(f'file://{tmp_path}/x')[1] == f'{tmp_path}/x'
    fs, p = open_uri('s3://bkt/some/prefix/')
    assert (fs.type_name, p) == ('s3', 'bkt/some/prefix')
    fs, p = open_uri('memory://bkt/x')
    assert (fs.type_name, p) == ('py::fsspec+memory', '/bkt/x')
    with pytest.raises(ValueError, match="'s3:///x' names no bucket"): open_uri('s3:///x')


def test_list_files_and_endpoint_from_env(s3, proxy, monkeypatch, moto):
    root, objs = s3
    moto.put(root.split('/')[2], {'data/.hidden/x.bin': b'x', 'data/sub/y.txt': b'yy'})
    got = list_files(root)
    assert got == sorted([RemoteFile(k, len(v)) for k, v in objs.items()] + [RemoteFile('sub/y.txt', 2)])
    assert list_files(root, suffix='.txt') == [RemoteFile('sub/y.txt', 2)]
    assert len(proxy.requests('list-type', 'GET')) == 2          # listings went through the endpoint we set
    monkeypatch.setenv('AWS_ENDPOINT_URL', 'http://127.0.0.1:9')  # nothing listens there ...
    monkeypatch.setenv('AWS_ENDPOINT_URL_S3', proxy.endpoint)     # ... but the S3-specific variable wins
    assert list_files(root, suffix='.txt') == [RemoteFile('sub/y.txt', 2)]


def test_is_transient():
    assert is_transient(OSError('AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate.'))
    assert is_transient(OSError('AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56'))
    assert is_transient(ConnectionResetError(104, 'Connection reset by peer'))
    assert not is_transient(FileNotFoundError('gone'))
    assert not is_transient(OSError('AWS Error ACCESS_DENIED during HeadObject operation'))
    assert not is_transient(ValueError('a bug'))


# ---- fetch, verify, hit, prefetch --------------------------------------------------------------------

def test_fetch_verify_then_hit(s3, tmp_path, proxy):
    root, objs = s3
    c = FileCache(root, tmp_path/'c', sha256={k: sha(v) for k, v in objs.items()}, **FAST)
    assert sorted(c.files) == sorted(objs) and c.files[NAMES[1]] == len(objs[NAMES[1]])
    p = c.local(NAMES[1])
    assert p == tmp_path/'c'/'files'/NAMES[1] and p.read_bytes() == objs[NAMES[1]]
    assert c.local(NAMES[1]) == p
    s = c.stats()
    assert (s['misses'], s['hits'], s['fetched_bytes'], s['retries'], s['cached_files']) == (1, 1, len(objs[NAMES[1]]), 0, 1)
    assert len(proxy.requests(NAMES[1])) == 1 and temps(tmp_path/'c') == []
    c.close()


def test_prefetch_along_the_plan(s3, tmp_path, proxy):
    root, objs = s3
    c = FileCache(root, tmp_path/'c', prefetch=2, **FAST)
    fetched = lambda: c.stats()['misses'] + c.stats()['prefetched']
    c.want(NAMES)                                                # starts fetching the first two at once
    assert c.local(NAMES[0]).read_bytes() == objs[NAMES[0]]      # a miss, or a wait for the prefetch already under way
    until(lambda: fetched() == 3 and c.stats()['inflight'] == 0, what='the next two files prefetched')
    assert sorted(finished(tmp_path/'c')) == NAMES[:3]           # the current file and the next two, no further
    before = c.stats()
    for n in NAMES[1:3]: assert c.local(n).read_bytes() == objs[n]
    s = c.stats()
    assert (s['hits'] - before['hits'], s['misses'] - before['misses'], s['hits'] + s['waits'] + s['misses']) == (2, 0, 3)
    until(lambda: fetched() == 5 and c.stats()['inflight'] == 0, what='the window moved on')
    assert sorted(finished(tmp_path/'c')) == NAMES[:5]
    assert [len(proxy.requests(n)) for n in NAMES] == [1] * 5 + [0] * 3   # each object read once
    c.close()


def test_a_slow_rescan_does_not_overwrite_a_newer_one(s3, tmp_path, monkeypatch):
    "Two threads rescan the cache folder at once: the totals kept are those of the listing that started last, not of the one that ended last."
    import nanochat_dl.io.cachedir as R
    root, objs = s3
    c = FileCache(root, tmp_path/'c', prefetch=0, **FAST)
    c.local(NAMES[0])
    real, listed, go = os.walk, threading.Event(), threading.Event()
    def walk(top, *a, **kw):
        out = list(real(top, *a, **kw))
        if threading.current_thread().name == 'slow': listed.set(); go.wait(30)   # listed (one file), then held back
        return iter(out)
    monkeypatch.setattr(R.os, 'walk', walk)
    t = threading.Thread(target=c._scan, name='slow'); t.start()
    assert listed.wait(30)
    c.local(NAMES[1])                                            # fetched: a newer rescan counts two files
    go.set(); t.join(30)
    s = c.stats()
    assert (s['cached_files'], s['cached_bytes']) == (2, len(objs[NAMES[0]]) + len(objs[NAMES[1]]))
    c.close()


def test_local_root_is_used_in_place(tmp_path):
    (tmp_path/'d').mkdir(); (tmp_path/'d'/'a.bin').write_bytes(b'abc')
    c = FileCache(tmp_path/'d')
    assert c.local('a.bin') == tmp_path/'d'/'a.bin' and c.cache_dir is None
    assert c.stats()['hits'] == 1
    with pytest.raises(FileNotFoundError, match="'b.bin' is not a file under"): c.local('b.bin')
    with pytest.raises(FileNotFoundError, match='is not a folder'): FileCache(tmp_path/'none')


# ---- faults -------------------------------------------------------------------------------------------

@pytest.mark.parametrize('fault', ['slowdown', 'reset', 'truncate', 'stall', 'corrupt', 'head503'])
def test_transient_faults_are_retried(s3, tmp_path, proxy, fault):
    root, objs = s3
    n = NAMES[2]
    kw = dict(slowdown=dict(kind='status', count=2), reset=dict(kind='reset', after=30_000, skip=1),
              truncate=dict(kind='truncate', after=30_000, skip=1), stall=dict(kind='stall', after=30_000, skip=1),
              corrupt=dict(kind='corrupt'), head503=dict(kind='status', method='HEAD'))[fault]
    proxy.add(path=n, **kw)
    c = FileCache(root, tmp_path/'c', sha256={n: sha(objs[n])}, chunk_size=64 << 10, **dict(FAST, timeout=1))
    assert c.local(n).read_bytes() == objs[n]
    assert c.stats()['retries'] == (2 if fault == 'slowdown' else 1)
    assert temps(tmp_path/'c') == []
    if fault in ('reset', 'truncate', 'stall'):                 # the second chunk was cut: the retry resumes there
        got = proxy.ranges(n)
        assert got[:3] == ['bytes=0-65535', 'bytes=65536-131071', 'bytes=65536-131071'], got
    if fault == 'corrupt':                                      # a bad sha256 starts over from byte 0
        assert proxy.ranges(n).count('bytes=0-65535') == 2
    c.close()


def test_a_body_shorter_than_its_size_is_refused(tmp_path):
    "A filesystem that says 5000 bytes and then ends its body at 3000 (as a silently cut stream would): never renamed into place."
    import io
    import pyarrow.fs as pafs
    from fsspec.implementations.memory import MemoryFileSystem
    from nanochat_dl.io.fetch import fetch_file
    class Cut(io.BytesIO):
        def read(self, n=-1):
            return super().read(max(0, min(n if n >= 0 else 1 << 30, 3000 - self.tell())))
    class ShortReads(MemoryFileSystem):
        def _open(self, path, mode='rb', **kw):
            return Cut(self.cat_file(path)) if 'r' in mode else super()._open(path, mode, **kw)
    m = ShortReads(); m.pipe('/short/a.bin', b'y' * 5000)
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(m))
    with pytest.raises(FetchError, match=r"memory://short/a.bin: received 3,000 bytes, expected 5,000; refused after 2 tries"):
        fetch_file(fs, '/short/a.bin', tmp_path/'a.bin', size=5000, uri='memory://short/a.bin', backoff=0.01)
    assert sorted(os.listdir(tmp_path)) == []


def test_truncated_object_refused_then_named(s3, tmp_path, proxy):
    root, objs = s3
    n = NAMES[3]
    proxy.add('truncate', path=n, count=100, after=1000)
    c = FileCache(root, tmp_path/'c', attempts=4, **FAST)
    with pytest.raises(FetchError, match=rf"{root}/{n}: gave up after 4 tries: .*partial file"):
        c.local(n)
    assert finished(tmp_path/'c') == {} and temps(tmp_path/'c') == []
    assert c.stats()['retries'] == 3


def test_store_shorter_than_listed_is_refused(s3, tmp_path, moto):
    root, objs = s3
    c = FileCache(root, tmp_path/'c', **FAST)
    moto.put(root.split('/')[2], {f'data/{NAMES[0]}': objs[NAMES[0]][:-10]})
    size = len(objs[NAMES[0]])
    with pytest.raises(FetchError, match=rf"{root}/{NAMES[0]}: the store has {size - 10:,} bytes, expected {size:,} "
                                          r"\(from the listing\); refused after 2 tries"):
        c.local(NAMES[0])
    assert finished(tmp_path/'c') == {} and temps(tmp_path/'c') == []


def test_replaced_object_refused_by_sha256(s3, tmp_path, moto):
    root, objs = s3
    n = NAMES[4]
    other = bytes(b ^ 1 for b in objs[n])                            # same size, other bytes
    moto.put(root.split('/')[2], {f'data/{n}': other})
    c = FileCache(root, tmp_path/'c', sha256={n: sha(objs[n])}, **FAST)
    with pytest.raises(FetchError, match=rf"{root}/{n}: sha256 {sha(other)}, expected {sha(objs[n])}; refused after 2 tries"):
        c.local(n)
    assert finished(tmp_path/'c') == {} and temps(tmp_path/'c') == []
    assert FileCache(root, tmp_path/'c2', **FAST).local(n).read_bytes() == other   # without a digest, the size is all we check


def test_permanent_errors_are_not_retried(s3, tmp_path, proxy, moto):
    root, objs = s3
    c = FileCache(root, tmp_path/'c', **FAST)
    moto.client().delete_object(Bucket=root.split('/')[2], Key=f'data/{NAMES[5]}')
    with pytest.raises(FetchError, match=rf"{root}/{NAMES[5]}: FileNotFoundError") as e: c.local(NAMES[5])
    assert e.value.tries == 1
    proxy.add('status', path=NAMES[6], method='HEAD', status=403)
    with pytest.raises(FetchError, match=rf"{root}/{NAMES[6]}: OSError: .*ACCESS_DENIED") as e: c.local(NAMES[6])
    assert e.value.tries == 1 and c.stats()['retries'] == 0
    import pickle                                                   # an error from a worker process arrives whole
    back = pickle.loads(pickle.dumps(e.value))
    assert (type(back), str(back), back.uri, back.tries) == (FetchError, str(e.value), f'{root}/{NAMES[6]}', 1)
    with pytest.raises(FileNotFoundError, match=r"'nope.bin' is not a file under s3://"): c.local('nope.bin')


def test_server_killed_and_restarted_while_needed(tmp_path, monkeypatch):
    with MotoServer() as m, FaultProxy(m.port) as px:
        for k, v in s3_env(px.endpoint).items(): monkeypatch.setenv(k, v)
        objs = blobs(3)
        m.put('restart', objs)
        c = FileCache('s3://restart/data', tmp_path/'c', attempts=10_000, **FAST)
        px.down = True; m.kill()                                  # the proxy resets connections, as a dead server does
        out = {}
        t = threading.Thread(target=lambda: out.setdefault('p', c.local(NAMES[1])), daemon=True)
        t.start()
        until(lambda: c.stats()['retries'] >= 3, what='retries while the server is down')
        assert finished(tmp_path/'c') == {}                       # nothing partial is ever in place
        m.start(); m.put('restart', objs); px.down = False        # moto forgets: the store would still have them
        t.join(60)
        assert not t.is_alive() and out['p'].read_bytes() == objs[f'data/{NAMES[1]}']
        assert finished(tmp_path/'c') == {NAMES[1]: objs[f'data/{NAMES[1]}']} and temps(tmp_path/'c') == []
        c.close()


# ---- eviction under a cap ------------------------------------------------------------------------------

def test_cap_smaller_than_the_dataset(s3, tmp_path):
    root, objs = s3
    cap = sum(sorted(len(v) for v in objs.values())[-3:])           # room for three files
    c = FileCache(root, tmp_path/'c', cache_size=cap, prefetch=1, sha256={k: sha(v) for k, v in objs.items()}, **FAST)
    plan = NAMES + NAMES[::-1] + NAMES
    c.want(plan)
    for n in plan:
        with open(c.local(n), 'rb') as f: assert f.read() == objs[n]
        held = finished(tmp_path/'c')
        assert sum(map(len, held.values())) <= cap and all(objs[k] == v for k, v in held.items())
    s = c.stats()
    assert s['evictions'] > 0 and s['over_cap'] == 0 and s['cached_bytes'] <= cap
    assert s['hits'] + s['waits'] + s['misses'] == len(plan)
    assert s['cached_bytes'] == sum(map(len, finished(tmp_path/'c').values()))
    c.close()


def test_pinned_files_are_not_evicted(s3, tmp_path):
    root, objs = s3
    cap = 2 * max(len(v) for v in objs.values())
    c = FileCache(root, tmp_path/'c', cache_size=cap, prefetch=0, **FAST)
    a = c.pin(NAMES[0])
    for n in NAMES[1:]:
        with c.pinned(n) as p: assert p.read_bytes() == objs[n]
        assert a.read_bytes() == objs[NAMES[0]]                    # still there, every time
    c.unpin(NAMES[0])
    for n in NAMES[1:4]: c.local(n)
    assert NAMES[0] not in finished(tmp_path/'c')
    with pytest.raises(ValueError, match=f"'{NAMES[0]}' is not pinned"): c.unpin(NAMES[0])
    with pytest.raises(ValueError, match='smaller than .*part_007.bin'): FileCache(root, tmp_path/'c', cache_size=1000)


PINNER = r'''
import sys
from nanochat_dl.io.cache import FileCache
c = FileCache(sys.argv[1], sys.argv[2], cache_size=int(sys.argv[3]), prefetch=0, backoff=0.01, max_backoff=0.05, timeout=5)
c.pin(sys.argv[4]); print('pinned', flush=True)
sys.stdin.readline()                                      # hold the pin until told to go
'''


def test_a_pin_holds_across_processes(s3, tmp_path):
    "A copy pinned by another process sharing the folder is passed over by eviction, and evicted once that process is gone."
    root, objs = s3
    cap = 2 * max(len(v) for v in objs.values())
    p = subprocess.Popen([sys.executable, '-c', PINNER, root, str(tmp_path/'c'), str(cap), NAMES[0]],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == 'pinned'
        c = FileCache(root, tmp_path/'c', cache_size=cap, prefetch=0, **FAST)
        for n in NAMES[1:5]: assert c.local(n).read_bytes() == objs[n]
        assert NAMES[0] in finished(tmp_path/'c') and c.stats()['evictions'] == 2   # 1 and 2 went, 0 stayed
    finally:
        p.communicate('\n', timeout=60)
    for n in NAMES[5:7]: c.local(n)
    assert NAMES[0] not in finished(tmp_path/'c')


def test_open_file_survives_eviction(s3, tmp_path):
    "What readers rely on: a copy evicted while open (or memory-mapped) stays readable through that handle (POSIX unlink)."
    import pyarrow as pa
    root, objs = s3
    c = FileCache(root, tmp_path/'c', cache_size=2 * max(len(v) for v in objs.values()), prefetch=0, hold=0, **FAST)
    m = pa.memory_map(str(c.local(NAMES[0])))
    for n in NAMES[1:4]: c.local(n)
    assert not c.path(NAMES[0]).exists() and m.read_buffer().to_pybytes() == objs[NAMES[0]]


# ---- offline, restarts, sharing, crashes ------------------------------------------------------------------

def test_offline_after_a_full_pass(tmp_path, monkeypatch):
    with MotoServer() as m:
        px = FaultProxy(m.port).start()
        for k, v in s3_env(px.endpoint).items(): monkeypatch.setenv(k, v)
        objs = blobs(4); m.put('offline', objs)
        with FileCache('s3://offline/data', tmp_path/'c', **FAST) as c:
            for n in c.files: c.local(n)
        px.stop()
    wait_port(px.port, up=False)
    c = FileCache('s3://offline/data', tmp_path/'c', attempts=1, **FAST)   # restart: the listing comes from the cache
    c.want(list(c.files))
    assert {n: c.local(n).read_bytes() for n in c.files} == {k.removeprefix('data/'): v for k, v in objs.items()}
    s = c.stats()
    assert (s['hits'], s['misses'], s['fetched_bytes'], s['retries'], s['errors']) == (4, 0, 0, 0, 0)
    with pytest.raises(FetchError, match='s3://offline/data: gave up after 1 tries'):
        FileCache('s3://offline/data', tmp_path/'c', refresh=True, attempts=1, **FAST)
    with pytest.raises(ValueError, match="caches 's3://offline/data', not 's3://other/data'"):
        FileCache('s3://other/data', tmp_path/'c')


WORKER = r'''
import hashlib, json, sys
from nanochat_dl.io.cache import FileCache
root, cache_dir, cap, order, manifest = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), json.loads(sys.argv[5])
c = FileCache(root, cache_dir, cache_size=cap, prefetch=1, threads=1, sha256=manifest, backoff=0.01, max_backoff=0.05, timeout=5)
c.want(order)
for n in order:
    with c.pinned(n) as p:
        assert hashlib.sha256(p.read_bytes()).hexdigest() == manifest[n], n
print(json.dumps(c.stats())); c.close()
'''


def test_two_processes_share_one_cache_folder(s3, tmp_path):
    import json
    root, objs = s3
    manifest = {k: sha(v) for k, v in objs.items()}
    cap = sum(sorted(len(v) for v in objs.values())[-6:])            # 2 pinned + 2 x 2 being fetched always fit: never over the cap
    orders = [NAMES * 3, (NAMES[::-1] + NAMES) * 2]
    procs = [subprocess.Popen([sys.executable, '-c', WORKER, root, str(tmp_path/'c'), str(cap), json.dumps(o), json.dumps(manifest)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for o in orders]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    stats = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert [s['hits'] + s['waits'] + s['misses'] for s in stats] == [len(o) for o in orders]
    assert [s['over_cap'] for s in stats] == [0, 0] and all(s['evictions'] > 0 for s in stats)
    held = finished(tmp_path/'c')
    assert all(objs[k] == v for k, v in held.items()) and sum(map(len, held.values())) <= cap
    assert temps(tmp_path/'c') == []


CRASHER = r'''
import sys
from nanochat_dl.io.cache import FileCache
FileCache(sys.argv[1], sys.argv[2], timeout=60, chunk_size=1 << 16).local(sys.argv[3])
'''


def test_kill_9_mid_fetch_leaves_nothing_to_read(s3, tmp_path, proxy):
    root, objs = s3
    n = NAMES[7]
    proxy.add('stall', path=n, after=30_000, skip=1)               # the first 64 KiB chunk, then part of the second, then nothing
    p = subprocess.Popen([sys.executable, '-c', CRASHER, root, str(tmp_path/'c'), n], stderr=subprocess.PIPE)
    try:
        until(lambda: [f.stat().st_size for f in (tmp_path/'c'/'.tmp').glob('*.part')] == [1 << 16], what='a partial download')
    finally:
        p.send_signal(signal.SIGKILL); p.wait(30)
    proxy.release()
    assert finished(tmp_path/'c') == {} and len(temps(tmp_path/'c')) == 1   # only the temp file: no name a reader would open
    c = FileCache(root, tmp_path/'c', **FAST)                              # the next start removes it
    assert temps(tmp_path/'c') == []
    assert c.local(n).read_bytes() == objs[n] and c.stats()['misses'] == 1


def test_the_cache_dir_expands_home(s3, tmp_path, monkeypatch):
    "`cache_dir='~/...'` is a folder under HOME, as every path argument is (the README's example; a folder named '~' before)."
    root, objs = s3
    monkeypatch.setenv('HOME', str(tmp_path/'home'))
    monkeypatch.chdir(tmp_path)
    c = FileCache(root, '~/nvme/cache', **FAST)
    try: assert c.local(NAMES[1]) == tmp_path/'home'/'nvme'/'cache'/'files'/NAMES[1] and not (tmp_path/'~').exists()
    finally: c.close()
