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
