"""Object storage under faults (issue 19 §4), against moto on 127.0.0.1 behind the fault-injecting proxy:
`close()` does not wait out a stalled request, a re-tokenized bucket is seen by the next loader on the
same cache folder, and nothing but a regular file in the cache folder is ever opened as a copy."""
import itertools, os, re, subprocess, sys, threading, time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3util import moto, proxy, until, use_proxy   # noqa: F401 (fixtures)
from test_s3_loaders import KW, PKW, objects, text, token_root   # noqa: F401 (text: a fixture)

from nanochat_dl.tokens import TokenFile, TokenRoot
from nanochat_dl.io.cache import FileCache
from nanochat_dl.tokens.loader import StreamingLoader

pytest.importorskip('moto')
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
SLOW = dict(backoff=0.01, max_backoff=0.05)        # retries fast, but a request may stall for the default 30 s



def lingering(): return [t.name for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not threading.main_thread()]


def close_while_next_waits(ld, proxy, suffix):
    "A `next()` in a thread, a GET of a `suffix` file stalled, then `close()`: within 2 s, the `next()` raising; what it raised."
    err = []
    def take():
        try: next(ld)
        except BaseException as e: err.append(e)
    t = threading.Thread(target=take, daemon=True); t.start()
    until(lambda: 'stall' in proxy.requests(suffix), what='a stalled GET')
    time.sleep(0.3)
    t0 = time.monotonic(); ld.close(); dt = time.monotonic() - t0
    t.join(5)
    assert dt < 2.0, f"close() took {dt:.1f} s"
    assert not t.is_alive() and len(err) == 1 and isinstance(err[0], RuntimeError), err
    return err[0]


@pytest.fixture
def bucket(moto, proxy, monkeypatch, request): return use_proxy(proxy, monkeypatch, request)


@pytest.mark.parametrize('prefetch', [0, 2])
def test_close_gives_up_a_stalled_fetch(moto, proxy, bucket, tmp_path, prefetch):
    "Every token file's GET stalls after 100 bytes: `close()` from another thread returns within about a second, the `next()` waiting gets an error saying the loader was closed, nothing half-written is in the cache, and the stalled fetches, once the requests end, leave no temp file."
    local = token_root(tmp_path/'root')
    moto.put(bucket, objects(local, 'tokens'))
    proxy.add('stall', path='.arrow', count=10_000, after=100)
    ld = StreamingLoader(TokenRoot(f's3://{bucket}/tokens', cache_dir=tmp_path/'c', fetch=SLOW), **dict(KW, prefetch=prefetch))
    err = [close_while_next_waits(ld, proxy, '.arrow')]
    assert re.search(r'this loader was closed (while waiting for|while it made) a batch', str(err[0])), err[0]
    assert ld._thread is None or not ld._thread.is_alive()
    assert lingering() == []
    assert [p for p in (tmp_path/'c'/'files').rglob('*.arrow')] == []               # no copy of a stalled file
    proxy.release()                                                                  # the requests end (cut short)
    until(lambda: list((tmp_path/'c'/'.tmp').iterdir()) == [], 30, 'the abandoned fetches removing their temp files')
    assert [p for p in (tmp_path/'c'/'files').rglob('*.arrow')] == []


# ---- the cached listing follows the store --------------------------------------------------------------

def replace_prefix(moto, bucket, prefix, objs):
    "The bucket's objects under `prefix/` replaced by `objs` (as a re-tokenize with --overwrite leaves them)."
    c = moto.client()
    for o in c.list_objects_v2(Bucket=bucket, Prefix=prefix + '/').get('Contents', []): c.delete_object(Bucket=bucket, Key=o['Key'])
    moto.put(bucket, objs)


def run(ld, n=30):
    try: return [b.rows.copy() for b in itertools.islice(ld, n)]
    finally: ld.close()


V2 = {'web': {'a.arrow': 120, 'b.arrow': 50, 'd.arrow': 30}, 'code': {'x.arrow': 60, 'y.arrow': 40}}


def test_a_retokenized_bucket_is_seen_by_the_next_loader(moto, bucket, tmp_path):
    "A loader reads the bucket (its listing and copies cached); the prefix is re-tokenized with other data (files of the same names, one gone, one new); a new loader on the same cache folder streams exactly the new data, and no copy of a changed file survives."
    old, new = token_root(tmp_path/'v1', seed=0), token_root(tmp_path/'v2', V2, seed=1)
    uri, c = f's3://{bucket}/tokens', tmp_path/'c'
    moto.put(bucket, objects(old, 'tokens'))
    assert all(len(b) for b in run(StreamingLoader(uri, **KW, cache_dir=c), 60))       # every file cached
    replace_prefix(moto, bucket, 'tokens', objects(new, 'tokens'))
    want = run(StreamingLoader(new, **KW))
    got = run(StreamingLoader(uri, **KW, cache_dir=c))
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    for p in (c/'files').rglob('*'):                                                  # every copy is the new file's
        if p.is_file(): assert p.read_bytes() == (new/p.relative_to(c/'files')).read_bytes(), p
    assert not (c/'files'/'web'/'sub'/'c.arrow').exists()                             # gone from the store: gone here


def test_a_changed_file_is_never_read_from_an_old_copy(moto, bucket, tmp_path):
    "Without a manifest (counts only), a file rewritten at the same size and count is fetched again: the listing's size and time of each file are checked on open, and a copy of a file that changed is removed."
    old = token_root(tmp_path/'v1', seed=0)
    (old/'meta'/'manifest.json').unlink()
    uri, c = f's3://{bucket}/tokens', tmp_path/'c'
    moto.put(bucket, objects(old, 'tokens'))
    run(StreamingLoader(uri, **KW, cache_dir=c), 60)
    assert (c/'files'/'code'/'y.arrow').exists()
    time.sleep(1.1)                                                                   # S3 times are to the second
    p = old/'code'/'y.arrow'; b = bytearray(p.read_bytes())
    with TokenFile(p) as tf: tok = next(tf.doc(i)[-1] for i in range(len(tf) // 2, len(tf)) if len(tf.doc(i)))
    i = bytes(b).index(np.uint32(tok).tobytes())
    b[i] ^= 1; p.write_bytes(bytes(b))                                                # one token of one document changed
    moto.put(bucket, {'tokens/code/y.arrow': bytes(b)})
    want = run(StreamingLoader(old, **KW))
    got = run(StreamingLoader(uri, **KW, cache_dir=c))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert (c/'files'/'code'/'y.arrow').read_bytes() == bytes(b)


def test_refresh_lists_again(moto, bucket, tmp_path):
    "`TokenRoot(refresh=True)` lists the store again even when nothing seems changed (and the loaders' roots can be given so)."
    old = token_root(tmp_path/'v1', seed=0)
    uri, c = f's3://{bucket}/tokens', tmp_path/'c'
    moto.put(bucket, objects(old, 'tokens'))
    TokenRoot(uri, cache_dir=c).close()
    idx = c/'index.json'; before = idx.stat().st_mtime_ns
    TokenRoot(uri, cache_dir=c).close()
    assert idx.stat().st_mtime_ns == before                                           # unchanged: the index is kept
    tr = TokenRoot(uri, cache_dir=c, refresh=True)
    assert idx.stat().st_mtime_ns != before
    assert run(StreamingLoader(tr, **KW), 5)



def index_inode(c):   # changes each time the listing is written again (an inode alone may be reused)
    st = (c/'index.json').stat()
    return st.st_ino, st.st_mtime_ns


def test_the_loaders_refresh_lists_again(moto, bucket, tmp_path):
    "`StreamingLoader(..., refresh=True)` and `StreamingDataset(..., refresh=True)` (in each DataLoader worker too) list the store again and write the listing again though its stamp matches the store (without `refresh`, the listing is kept); `refresh` changes no batch, config or fingerprint."
    from torchdata.stateful_dataloader import StatefulDataLoader
    from nanochat_dl.tokens import StreamingDataset
    old = token_root(tmp_path/'v1', seed=0)
    uri, c = f's3://{bucket}/tokens', tmp_path/'c'
    moto.put(bucket, objects(old, 'tokens'))
    want = run(StreamingLoader(old, **KW))
    TokenRoot(uri, cache_dir=c).close()
    i0 = index_inode(c)
    StreamingLoader(uri, **KW, cache_dir=c).close()
    assert index_inode(c) == i0                                               # the stamp matches: the listing kept
    ld = StreamingLoader(uri, **KW, cache_dir=c, refresh=True)
    assert index_inode(c) != i0                                               # listed again
    assert 'refresh' not in ld.config and ld.fingerprint == StreamingLoader(old, **KW).fingerprint
    got = run(ld)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    kw = dict(n_logical_shards=16, shuffle_window=20, seed=3, bos_token=1)
    rows = lambda ds: [x.clone() for x, _ in itertools.islice(StatefulDataLoader(ds, batch_size=4, num_workers=2, timeout=120), 12)]
    ds = StreamingDataset(uri, 32, **kw, cache_dir=c, refresh=True)
    i1 = index_inode(c)
    got = rows(ds)
    assert index_inode(c) != i1                                               # each worker lists again
    want = rows(StreamingDataset(old, 32, **kw))
    assert len(got) == len(want) == 12 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_packed_loader_refresh_lists_again(text, moto, bucket, tmp_path):
    "`PackedLoader(data_dir=URI, refresh=True)` lists the bucket again though the cached listing's stamp matches it."
    from nanochat_dl.text.loader import PackedLoader
    moto.put(bucket, objects(text[0], 'text'))
    uri, c = f's3://{bucket}/text', tmp_path/'c'
    n = len(list(text[0].glob('*.parquet')))
    with PackedLoader(text[1], data_dir=uri, cache_dir=c, **PKW) as ld: assert len(ld.files) == n - 1
    i0 = index_inode(c)
    with PackedLoader(text[1], data_dir=uri, cache_dir=c, **PKW) as ld: assert len(ld.files) == n - 1
    assert index_inode(c) == i0                                               # kept
    with PackedLoader(text[1], data_dir=text[0], **PKW) as ld: want = [b[0].clone() for b in itertools.islice(ld, 3)]
    with PackedLoader(text[1], data_dir=uri, cache_dir=c, refresh=True, **PKW) as ld:
        assert index_inode(c) != i0 and len(ld.files) == n - 1 and 'refresh' not in ld.config
        assert all(torch.equal(b[0], w) for b, w in zip(itertools.islice(ld, 3), want))


# ---- only regular files are copies -----------------------------------------------------------------------

PINNER = r'''
import sys
from nanochat_dl.io.cache import FileCache
c = FileCache(sys.argv[1], sys.argv[2], attempts=1, backoff=0.01, timeout=5)
try: c.pin(sys.argv[3])
except ValueError as e: print('refused:', e)
'''


@pytest.mark.parametrize('kind', ['fifo', 'symlink', 'folder'])
def test_a_fifo_or_link_in_the_cache_is_refused_by_name(moto, bucket, tmp_path, kind):
    "Something not a regular file under a cached file's name (an empty object: its size matches anything's) is refused, naming it; a FIFO never hangs the reader (run in a child process with a timeout)."
    moto.put(bucket, {'data/empty.bin': b'', 'data/full.bin': b'x' * 100})
    uri, c = f's3://{bucket}/data', tmp_path/'c'
    FileCache(uri, c).close()
    p = c/'files'/'empty.bin'
    if kind == 'fifo': os.mkfifo(p)
    elif kind == 'symlink': (tmp_path/'elsewhere').write_bytes(b''); p.symlink_to(tmp_path/'elsewhere')
    else: p.mkdir()
    r = subprocess.run([sys.executable, '-c', PINNER, uri, str(c), 'empty.bin'], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    kinds = dict(fifo='a FIFO', symlink='a symbolic link', folder='a folder')
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"refused: {p} is {kinds[kind]}: expected the cached copy of {uri}/empty.bin" in r.stdout, (r.stdout, r.stderr[-2000:])



@pytest.mark.parametrize('prefetch', [0, 2])
def test_packed_loader_close_gives_up_a_stalled_fetch(text, moto, proxy, bucket, tmp_path, prefetch, monkeypatch):
    "The same for `PackedLoader` over a bucket of parquet shards: once it has read the shards' footers, every GET stalls (and nothing is fetched ahead); `close()` returns within about a second and the waiting `next()` says the loader was closed."
    from nanochat_dl.text.loader import PackedLoader
    monkeypatch.setattr(FileCache, '_kick', lambda self: None)                        # only the fetch a reader waits for
    moto.put(bucket, objects(text[0], 'text'))
    ld = PackedLoader(text[1], data_dir=f's3://{bucket}/text', cache_dir=tmp_path/'c', **dict(PKW, prefetch=prefetch))
    proxy.add('stall', path='.parquet', count=10_000, after=100)
    err = [close_while_next_waits(ld, proxy, '.parquet')]
    assert 'this loader was closed' in str(err[0]), err[0]
    whole = lambda: all(p.read_bytes() == (text[0]/p.name).read_bytes() for p in (tmp_path/'c'/'files').rglob('*') if p.is_file())
    assert lingering() == [] and whole()                                              # (a copy made before the stall is whole)
    proxy.release()
    until(lambda: list((tmp_path/'c'/'.tmp').iterdir()) == [], 30, 'the abandoned fetches removing their temp files')
    assert whole()


def test_an_index_of_the_older_form_still_loads(moto, bucket, tmp_path):
    "A cache folder written before the listing was checked (its index: root, suffix, files only) is used: its copies of files of the same size stay, another size is fetched again, and the index is rewritten with the times."
    import json
    moto.put(bucket, {'d/a.bin': b'a' * 10, 'd/b.bin': b'b' * 20})
    uri, c = f's3://{bucket}/d', tmp_path/'c'
    with FileCache(uri, c) as fc: fc.local('a.bin'); fc.local('b.bin')
    (c/'index.json').write_text(json.dumps({'root': uri, 'suffix': None, 'files': [['a.bin', 10], ['b.bin', 20]]}))
    moto.put(bucket, {'d/b.bin': b'B' * 21})
    with FileCache(uri, c) as fc:
        assert fc.files == {'a.bin': 10, 'b.bin': 21} and not fc.path('b.bin').exists()
        assert fc.local('b.bin').read_bytes() == b'B' * 21 and fc.stats()['hits'] == 0
        assert fc.local('a.bin').read_bytes() == b'a' * 10 and fc.stats()['hits'] == 1
    assert sorted(json.loads((c/'index.json').read_text())) == ['files', 'mtimes', 'root', 'stamp', 'suffix']
