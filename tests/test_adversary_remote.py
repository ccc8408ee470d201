"""Adversarial attacks on object storage (issue 19 §4), against moto on 127.0.0.1 behind the fault proxy: a cache
index damaged by hand, `close()` of one of two loaders sharing a root behind a stalled request, loaders opened
and closed in a loop (threads and descriptors counted). Every wait is bounded."""
import itertools, json, os, re, sys, threading, time, warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from s3util import moto, proxy, use_proxy   # noqa: F401 (fixtures)
from test_s3_loaders import KW, objects, token_root

from nanochat_dl.arrow import TokenRoot
from nanochat_dl.remote import FileCache
from nanochat_dl.streaming import StreamingLoader

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
