"""The loaders reading from object storage: a moto S3 server (a child process on 127.0.0.1) behind a
fault-injecting proxy. `StreamingLoader` over an arrow token root in a bucket and `PackedLoader` over
parquet text shards in a bucket give the batches they give over the same files on local disk; they
resume exactly, split the data exactly once across ranks, ride out a server killed and restarted
mid-epoch, refuse objects that are cut short or replaced (naming them), stay under a cache cap smaller
than the data, and run offline once everything is cached."""
import itertools, json, os, re, sys, threading, time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from s3util import FaultProxy, MotoServer, moto, proxy, s3_env, until, use_proxy   # noqa: F401 (moto, proxy: fixtures)

from nanochat_dl.tokens import TokenRoot, file_record, update_counts, update_manifest, write_token_file
from nanochat_dl.io.retries import FetchError
from nanochat_dl.tokens.loader import StreamingLoader

pytest.importorskip('moto')
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
FAST = dict(backoff=0.01, max_backoff=0.05, timeout=5)
SPEC = {'web': {'a.arrow': 120, 'b.arrow': 90, 'sub/c.arrow': 70}, 'code': {'x.arrow': 60, 'y.arrow': 40}}
KW = dict(seq_len=32, batch_size=4, n_logical_shards=16, shuffle_window=20, seed=3, bos_token=1, prefetch=0)



def token_root(path, spec=SPEC, seed=0):
    "Datasets `{name: {file: documents}}` with counts and a manifest; token = uid << 12 | position (each names its document)."
    rng, uid = np.random.default_rng(seed), 2
    for ds, files in spec.items():
        recs = {}
        for f, n in files.items():
            L = rng.integers(0, 80, n)
            write_token_file(Path(path)/ds/f, [(np.int64(uid + i) << 12) | (np.arange(l) & 0xFFF) for i, l in enumerate(L)])
            recs[f] = file_record(Path(path)/ds/f)
            uid += n
        update_counts(path, ds, {f: (r.documents, r.tokens) for f, r in recs.items()})
        update_manifest(path, ds, recs)
    return Path(path)


def objects(root, prefix):
    "Every file under `root` as `{prefix/relpath: bytes}` (hidden names skipped, as a sync tool would)."
    return {f"{prefix}/{p.relative_to(root).as_posix()}": p.read_bytes() for p in sorted(Path(root).rglob('*'))
            if p.is_file() and not any(s.startswith('.') for s in p.relative_to(root).parts)}


def arrow_bytes(root): return sum(p.stat().st_size for p in Path(root).rglob('*.arrow'))


def cache_bytes(d): return sum(p.stat().st_size for p in (Path(d)/'files').rglob('*') if p.is_file())


@pytest.fixture(scope='module')
def local(tmp_path_factory):
    return token_root(tmp_path_factory.mktemp('s3l')/'root')


@pytest.fixture
def bucket(moto, proxy, monkeypatch, request):
    "A fresh bucket name; the environment points at the proxy in front of moto."
    return use_proxy(proxy, monkeypatch, request)


@pytest.fixture
def s3root(moto, bucket, local):
    "The local token root uploaded under `s3://bucket/tokens`."
    moto.put(bucket, objects(local, 'tokens'))
    return f's3://{bucket}/tokens'


def batches(ld, n):
    "`n` batches' rows and states (JSON round trip), then the loader closed."
    try:
        out = []
        for b in itertools.islice(ld, n): out.append((b.rows.copy(), json.loads(json.dumps(b.state))))
        return out
    finally: ld.close()


from nanochat_dl.tokens import open_epochs   # per dataset, the lowest epoch that may still have tokens on a rank


def same(a, b):
    assert len(a) == len(b)
    for (r0, s0), (r1, s1) in zip(a, b):
        assert np.array_equal(r0, r1) and s0 == s1


# ---- StreamingLoader over an arrow root in a bucket -----------------------------------------------------

def test_stream_from_s3_equals_local(local, s3root, tmp_path):
    want = batches(StreamingLoader(local, **KW), 40)
    ld = StreamingLoader(s3root, **KW, cache_dir=tmp_path/'c')
    got, ms = [], []
    for b in itertools.islice(ld, 40): got.append((b.rows.copy(), json.loads(json.dumps(b.state)))); ms.append(b.metrics['cache'])
    ld.close()
    same(got, want)
    m = ms[-1]
    assert m['fetched_bytes'] >= arrow_bytes(local) and m['misses'] + m['waits'] + m['prefetched'] >= 5
    assert m['cached_bytes'] == cache_bytes(tmp_path/'c') and m['retries'] == 0
    assert [x['fetched_bytes'] for x in ms] == sorted(x['fetched_bytes'] for x in ms)   # counters, per batch
    assert not list((tmp_path/'c'/'.tmp').iterdir())


def test_local_metrics_have_no_cache(local):
    ld = StreamingLoader(local, **KW)
    assert next(ld).metrics['cache'] is None
    ld.close()


def test_resume_from_s3_is_exact(local, s3root, tmp_path):
    full = batches(StreamingLoader(s3root, **KW, cache_dir=tmp_path/'c'), 30)
    ld = StreamingLoader(s3root, **KW, cache_dir=tmp_path/'c2')                # a fresh cache: everything fetched again
    ld.load_state_dict(full[11][1])
    same(batches(ld, 18), full[12:])
    ld = StreamingLoader(local, **KW)                                            # and a state saved over S3 resumes on the local copy
    ld.load_state_dict(full[19][1])
    same(batches(ld, 10), full[20:])


def test_exactly_once_across_ranks(local, s3root, tmp_path):
    "Two ranks reading the bucket (sharing one cache folder): each rank's batches are its local batches, and together they deliver every token of epoch 1 once."
    seen = defaultdict(list)
    for rank in range(2):
        kw = dict(KW, rank=rank, world_size=2)
        want = batches(StreamingLoader(local, **kw), 5)
        ld = StreamingLoader(s3root, **kw, cache_dir=tmp_path/'c')
        for i in range(1000):
            if min(open_epochs(ld.state_dict()).values()) > 1: break
            b = next(ld)
            if i < 5: assert np.array_equal(b.rows, want[i][0])
            for r, row in enumerate(b.segments):
                for s in row:
                    if s.key.epoch == 1: seen[(s.key.dataset, s.key.file, s.key.doc)].append((s.offset, s.length))
        ld.close()
    tr = TokenRoot(local)
    for ds in tr.datasets:
        for fi in tr.files[ds]:
            for i, L in enumerate(tr.open(ds, fi.file).lens.tolist()):
                pieces, at = sorted(seen.get((ds, fi.file, i), [])), 0
                for off, n in pieces: assert off == at, (ds, fi.file, i, pieces); at += n
                assert at == L, (ds, fi.file, i, L, pieces)
    tr.close()


def test_cap_smaller_than_the_data(local, s3root, tmp_path):
    want = batches(StreamingLoader(local, **KW), 120)
    sizes = sorted((p.stat().st_size for p in local.rglob('*.arrow')), reverse=True)
    cap = sizes[0] + sizes[1] + 100                                   # two token files' worth, of five
    tr = TokenRoot(s3root, cache_dir=tmp_path/'c', cache_size=cap, fetch=FAST)
    assert tr.max_open == 2
    ld = StreamingLoader(tr, **KW)
    got, peak = [], 0
    for b in itertools.islice(ld, 120):
        got.append((b.rows.copy(), json.loads(json.dumps(b.state))))
        peak = max(peak, cache_bytes(tmp_path/'c'))
    m = b.metrics['cache']
    ld.close()
    same(got, want)
    assert peak <= cap and m['evictions'] > 0 and m['fetched_bytes'] > arrow_bytes(local)
    assert tr.cache.stats()['over_cap'] == 0


def test_streaming_dataset_from_s3(local, s3root, tmp_path, monkeypatch):
    "`StreamingDataset` over a bucket: DataLoader workers give the rows they give over local files, and resume from a list of states at another number of workers, every copy in the `cache_dir` given; the process that makes the dataset starts no download, each unit fetches its own files ahead."
    from torchdata.stateful_dataloader import StatefulDataLoader
    from nanochat_dl.tokens import StreamingDataset, owned_shards
    monkeypatch.setenv('NANOCHAT_DL_BASE_DIR', str(tmp_path/'base'))          # where a cache without cache_dir would go
    kw = dict(n_logical_shards=16, shuffle_window=20, seed=3, bos_token=1)
    rows = lambda it, n: [x.clone() for x, _ in itertools.islice(it, n)]
    def run(root, workers, state=None, **more):
        ds = StreamingDataset(root, 32, **kw, **more)
        if state is not None: ds.load_state_dict([state])
        return StatefulDataLoader(ds, batch_size=4, num_workers=workers, timeout=120)   # a worker stuck is an error, not a hang
    dl = run(local, 2)
    it = iter(dl)
    first, sd = rows(it, 4), dl.state_dict()
    want, want3 = first + rows(it, 6), rows(run(local, 3, sd), 8)
    threads = lambda: {t for t in threading.enumerate() if t.name.startswith('FileCache')}
    before = threads()
    ds = StreamingDataset(s3root, 32, **kw, cache_dir=tmp_path/'c')
    assert threads() == before                                                 # nothing fetched ahead in this process
    got = rows(StatefulDataLoader(ds, batch_size=4, num_workers=2, timeout=120), 10)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == 10
    got3 = rows(run(s3root, 3, sd, cache_dir=tmp_path/'c2'), 8)                # a list of states, 2 workers -> 3
    assert all(torch.equal(a, b) for a, b in zip(got3, want3)) and len(got3) == 8
    base = tmp_path/'base'                                                     # copies only where we said (the base dir holds
    assert (not base.exists() or os.listdir(base) == ['hashes']) and cache_bytes(tmp_path/'c2') > 0   # the local files' hashes only)
    # a unit (here rank 1 of 2, no workers) fetches ahead the files that hold its logical shards, and no others
    ds = StreamingDataset(s3root, 32, **kw, rank=1, world_size=2, cache_dir=tmp_path/'c3')
    next(iter(ds))
    own, tr, plan = owned_shards(16, 1, 2), TokenRoot(local), set(ds._stream.root.cache._plan)
    for d in tr.datasets:
        starts = np.cumsum([0] + [i.docs for i in tr.files[d]])
        lo, hi = starts[-1] * own.start // 16, starts[-1] * own.stop // 16
        assert {f"{d}/{i.file}" for i, a, b in zip(tr.files[d], starts, starts[1:]) if a < hi and b > lo} == {p for p in plan if p.startswith(d + '/')}
    ds._stream.root.close(); tr.close()


def test_a_forked_worker_builds_its_own_stream(local, s3root, tmp_path, monkeypatch):
    "The process that made a `StreamingDataset` used it (`state_dict()`: its stream fetches ahead, and a prefetch is under way) before a forked DataLoader worker of the same unit starts: the worker opens the root again rather than wait on a download of the parent's, which no thread of its own will finish."
    from torchdata.stateful_dataloader import StatefulDataLoader
    import nanochat_dl.io.cache as R
    from nanochat_dl.tokens.dataset import StreamingDataset
    kw = dict(n_logical_shards=16, shuffle_window=20, seed=3, bos_token=1)
    rows = lambda dl, n: [x.clone() for x, _ in itertools.islice(dl, n)]
    want = rows(StatefulDataLoader(StreamingDataset(local, 32, **kw), batch_size=4), 4)
    parent, real, gate = os.getpid(), R.FileCache._fetch, threading.Event()
    def held(self, rel, demand):                          # the parent's prefetches stay under way until the test ends
        if os.getpid() == parent and not demand: gate.wait(120)
        return real(self, rel, demand)
    monkeypatch.setattr(R.FileCache, '_fetch', held)
    ds = StreamingDataset(s3root, 32, **kw, cache_dir=tmp_path/'c')
    try:
        ds.state_dict()                                   # the parent's stream (unit 0 of 1) fetches its first files ahead
        until(lambda: len(ds._stream.root.cache._inflight) > 0, what="a prefetch under way")
        got = rows(StatefulDataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context='fork', timeout=60), 4)
    finally: gate.set()
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))
    ds._stream.root.close()


def test_a_forked_worker_never_takes_a_lock_the_parent_held_at_the_fork(s3root, local, tmp_path, monkeypatch):
    "A thread of the parent holds its stream's root and cache locks while a forked DataLoader worker starts: the worker drops the parent's stream (the parent's to close) instead of closing it, which would wait forever on a lock no thread of its own will release (CI hung here: a prefetch thread held the cache's lock at the fork). The parent's prefetches are held before their requests: pyarrow's S3 client cannot be made in a child forked while a request of the parent's was in flight, which the chapter says."
    from torchdata.stateful_dataloader import StatefulDataLoader
    import nanochat_dl.io.cache as R
    from nanochat_dl.tokens.dataset import StreamingDataset
    kw = dict(n_logical_shards=16, shuffle_window=20, seed=3, bos_token=1)
    rows = lambda dl, n: [x.clone() for x, _ in itertools.islice(dl, n)]
    want = rows(StatefulDataLoader(StreamingDataset(local, 32, **kw), batch_size=4), 4)
    parent, real, gate, took = os.getpid(), R.FileCache._fetch, threading.Event(), threading.Event()
    def held(self, rel, demand):
        if os.getpid() == parent and not demand: gate.wait(120)
        return real(self, rel, demand)
    monkeypatch.setattr(R.FileCache, '_fetch', held)
    ds = StreamingDataset(s3root, 32, **kw, cache_dir=tmp_path/'c')
    ds.state_dict()                                       # the parent's stream exists (unit 0 of 1)
    root = ds._stream.root
    def hold():
        with root._lock, root.cache._lock: took.set(); gate.wait(120)
    t = threading.Thread(target=hold, daemon=True); t.start(); took.wait(10)
    try: got = rows(StatefulDataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context='fork', timeout=30), 4)
    finally: gate.set(); t.join(10)
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))
    ds.close()


def test_a_token_root_given_is_opened_again_with_its_settings(local, s3root, tmp_path):
    "A `StreamingDataset` made from a `TokenRoot` opens it again where it iterates with the same settings: cache folder and cap, files fetched ahead, the fetch's retries and timeouts, the check of the files, the column."
    from nanochat_dl.tokens import StreamingDataset
    fetch = dict(attempts=2, backoff=0.01, max_backoff=0.05, timeout=5, threads=1)
    for root in (TokenRoot(s3root, cache_dir=tmp_path/'c', cache_size=10**6, prefetch=0, verify='off', fetch=fetch), TokenRoot(local, verify='full')):
        ds = StreamingDataset(root, 32, n_logical_shards=16, bos_token=1)
        next(iter(ds))                                    # no workers: built here, from the root opened again
        r = ds._stream.root
        assert r is not root and (r.column, r.verify) == (root.column, root.verify)
        if root.cache is not None:
            c = r.cache
            assert (c.cache_dir, c.cache_size, c.prefetch, c.attempts, c.backoff, c.max_backoff, c.timeout, c.threads) == \
                   (tmp_path/'c', 10**6, 0, 2, 0.01, 0.05, 5, 1)
        r.close(); root.close()


def test_offline_after_a_full_pass(local, moto, tmp_path, monkeypatch):
    px = FaultProxy(moto.port).start()
    for k, v in s3_env(px.endpoint).items(): monkeypatch.setenv(k, v)
    moto.put('offline-arrow', objects(local, 'tokens'))
    want = batches(StreamingLoader('s3://offline-arrow/tokens', **KW, cache_dir=tmp_path/'c'), 60)   # touches every file
    px.stop()
    tr = TokenRoot('s3://offline-arrow/tokens', cache_dir=tmp_path/'c', fetch=dict(FAST, attempts=1))
    got = batches(StreamingLoader(tr, **KW), 60)
    same(got, want)
    s = tr.cache.stats()
    assert (s['misses'], s['fetched_bytes'], s['retries']) == (0, 0, 0)


def test_server_killed_and_restarted_mid_epoch(local, tmp_path, monkeypatch):
    "Under a cap that keeps the loader fetching, the server dies mid-epoch: the loader waits, retrying, and continues once it is back; the batches are the local ones, none lost or repeated."
    want = batches(StreamingLoader(local, **KW), 80)
    sizes = sorted((p.stat().st_size for p in local.rglob('*.arrow')), reverse=True)
    objs = objects(local, 'tokens')
    with MotoServer() as m, FaultProxy(m.port) as px:
        for k, v in s3_env(px.endpoint).items(): monkeypatch.setenv(k, v)
        m.put('restart', objs)
        tr = TokenRoot('s3://restart/tokens', cache_dir=tmp_path/'c', cache_size=sizes[0] + sizes[1] + 100, prefetch=0,
                       fetch=dict(FAST, attempts=100_000))
        ld = StreamingLoader(tr, **KW)
        got = [(b.rows.copy(), json.loads(json.dumps(b.state))) for b in itertools.islice(ld, 20)]
        px.down = True; m.kill()                                     # the proxy resets connections, as a dead server does
        out, err = [], []
        def rest():
            try: out.extend((b.rows.copy(), json.loads(json.dumps(b.state))) for b in itertools.islice(ld, 60))
            except BaseException as e: err.append(e)
        t = threading.Thread(target=rest, daemon=True); t.start()
        until(lambda: tr.cache.stats()['retries'] >= 5, what='retries while the server is down')
        assert t.is_alive() and not err
        m.start(); m.put('restart', objs); px.down = False          # moto forgets: the store would still have them
        t.join(120)
        assert not t.is_alive() and not err, err
        ld.close()
    same(got + out, want)
    assert not list((tmp_path/'c'/'.tmp').iterdir())


def test_truncated_object_is_refused(local, moto, bucket, tmp_path):
    objs = objects(local, 'tokens')
    k = 'tokens/web/b.arrow'
    objs[k] = objs[k][:-100]
    moto.put(bucket, objs)
    n = (local/'web'/'b.arrow').stat().st_size
    with pytest.raises(ValueError, match=re.escape(f"s3://{bucket}/tokens/web/b.arrow changed since s3://{bucket}/tokens/meta/manifest.json "
                                                   f"recorded it ({n - 100} bytes in the store, the manifest records {n})")):
        StreamingLoader(f's3://{bucket}/tokens', **KW, cache_dir=tmp_path/'c')


def test_object_cut_after_listing_is_refused(local, moto, bucket, tmp_path):
    "The listing (cached) says one size, the store now holds fewer bytes: the fetch refuses it, naming the object."
    moto.put(bucket, objects(local, 'tokens'))
    tr = TokenRoot(f's3://{bucket}/tokens', cache_dir=tmp_path/'c', prefetch=0, fetch=FAST)
    moto.put(bucket, {'tokens/code/x.arrow': (local/'code'/'x.arrow').read_bytes()[:-10]})
    with pytest.raises(FetchError, match=re.escape(f"s3://{bucket}/tokens/code/x.arrow: the store has")):
        tr.open('code', 'x.arrow')
    assert not tr.path('code', 'x.arrow').exists()
    tr.close()


def test_object_replaced_is_refused_by_the_manifest_hash(local, moto, bucket, tmp_path):
    objs = objects(local, 'tokens')
    k = 'tokens/web/a.arrow'
    b = bytearray(objs[k]); b[len(b) // 3] ^= 0xFF; objs[k] = bytes(b)          # same size, other bytes
    moto.put(bucket, objs)
    ld = StreamingLoader(f's3://{bucket}/tokens', **KW, cache_dir=tmp_path/'c')
    with pytest.raises(FetchError, match=re.escape(f"s3://{bucket}/tokens/web/a.arrow: sha256 ")):
        for _ in range(50): next(ld)
    ld.close()
    assert not (tmp_path/'c'/'files'/'web'/'a.arrow').exists()


def test_damaged_cached_copy_is_fetched_again(local, s3root, tmp_path):
    "A copy damaged on local disk after it was cached (its end rewritten) is never read: the next start checks it and fetches it again."
    want = batches(StreamingLoader(s3root, **KW, cache_dir=tmp_path/'c'), 30)
    p = tmp_path/'c'/'files'/'web'/'a.arrow'
    b = bytearray(p.read_bytes()); b[-20] ^= 0xFF; p.write_bytes(bytes(b))
    tr = TokenRoot(s3root, cache_dir=tmp_path/'c', fetch=FAST)
    same(batches(StreamingLoader(tr, **KW), 30), want)
    assert tr.cache.stats()['fetched_bytes'] == (local/'web'/'a.arrow').stat().st_size
    assert p.read_bytes() == (local/'web'/'a.arrow').read_bytes()


# ---- PackedLoader over parquet text shards in a bucket -----------------------------------------------------

def words(f, g, r): return ' '.join([f"w{f}{g}{r}x"] * (1 + (7 * f + 3 * g + 5 * r) % 23))


@pytest.fixture(scope='module')
def text(tmp_path_factory):
    "Six toy shards (five train, one val) and a small tokenizer trained on the sample shards."
    from nanochat_dl.text.sample import make_sample_shards
    from nanochat_dl.testing import write_toy_shards
    from nanochat_dl.text.tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp('s3text')
    make_sample_shards(d/'sample')
    tok = train_tokenizer(d/'sample', vocab_size=512, out_dir=d/'tok', progress=False)
    write_toy_shards(d/'shards', [[6, 5, 7], [4, 8, 3, 5], [9, 2], [5, 5, 5], [7, 6, 4], [3, 3]], text_fn=words)
    return d/'shards', tok


PKW = dict(B=3, T=24, tokenizer_batch_size=4, buffer_size=8, device='cpu', tokenizer_threads=2, prefetch=0)


def packed(ld, n):
    try: return [(b.inputs.clone(), b.targets.clone(), json.loads(json.dumps(b.state)), b.metrics['cache']) for b in itertools.islice(ld, n)]
    finally: ld.close()


def same_packed(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b): assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]


@pytest.fixture
def s3text(moto, bucket, text):
    moto.put(bucket, objects(text[0], 'text'))
    return f's3://{bucket}/text'


@pytest.mark.parametrize('tokenize_in', ['processes', 'threads'])
def test_packed_loader_from_s3_equals_local(text, s3text, tmp_path, tokenize_in):
    from nanochat_dl.text.loader import PackedLoader
    shards, tok = text
    want = packed(PackedLoader(tok, data_dir=shards, tokenize_in=tokenize_in, **PKW), 40)
    ld = PackedLoader(tok, data_dir=s3text, cache_dir=tmp_path/'c', tokenize_in=tokenize_in, **PKW)
    got = packed(ld, 40)                                         # closed: the cache's threads are joined, its counters final
    same_packed(got, want)                                       # states too: same shards, same fingerprint
    assert want[-1][3] is None
    m, s = got[-1][3], ld.cache.stats()
    train = sum(p.stat().st_size for p in sorted(shards.glob('*.parquet'))[:-1])
    assert m['fetched_bytes'] == train and m['retries'] == 0     # every shard was read before the last batch
    # each shard fetched once, on demand or ahead (a read that waited for a prefetch counts in `waits` and `prefetched`;
    # a prefetch is counted after its copy is in place, so only a closed cache's counts are final)
    assert (s['fetched_bytes'], s['misses'] + s['prefetched'], s['retries']) == (train, 5, 0), s
    assert sorted(p.name for p in (tmp_path/'c'/'files').iterdir()) == sorted(p.name for p in shards.glob('*.parquet'))[:-1]


def test_packed_loader_resume_from_s3(text, s3text, tmp_path):
    from nanochat_dl.text.loader import PackedLoader
    shards, tok = text
    full = packed(PackedLoader(tok, data_dir=s3text, cache_dir=tmp_path/'c', **PKW), 40)
    again = packed(PackedLoader(tok, data_dir=s3text, cache_dir=tmp_path/'c2', resume_state_dict=full[14][2], **PKW), 25)
    same_packed(again, full[15:])
    local = packed(PackedLoader(tok, data_dir=shards, resume_state_dict=full[29][2], **PKW), 10)   # a state saved over S3 resumes on local files
    same_packed(local, full[30:])


def test_packed_loader_cap_smaller_than_the_data(text, s3text, tmp_path):
    from nanochat_dl.text.loader import PackedLoader
    shards, tok = text
    sizes = sorted((p.stat().st_size for p in shards.glob('*.parquet')), reverse=True)
    cap = sizes[0] + sizes[1] + 10
    # the files in flight are pinned: with read-ahead, a message of >= 256 documents spans all of these tiny shards (real
    # shards hold thousands of documents, a message spans one or two); read_ahead=0 keeps one slice in flight
    kw = dict(PKW, read_ahead=0)
    want = packed(PackedLoader(tok, data_dir=shards, **kw), 60)     # past the end of the first epoch
    ld = PackedLoader(tok, data_dir=s3text, cache_dir=tmp_path/'c', cache_size=cap, **kw)
    got, peak = [], 0
    for b in itertools.islice(ld, 60):
        got.append((b.inputs.clone(), b.targets.clone(), json.loads(json.dumps(b.state)), b.metrics['cache']))
        peak = max(peak, cache_bytes(tmp_path/'c'))
    over = ld.cache.stats()['over_cap']
    ld.close()
    same_packed(got, want)
    m = got[-1][3]
    assert peak <= cap and over == 0 and m['evictions'] > 0 and got[-1][2]['stages']['source']['cursor']['epoch'] >= 2


# ---- nanochat-dl tokenize --out s3://... ----------------------------------------------------------------------------

def listing(moto, bucket, prefix):
    "`{key under prefix: bytes}` of the objects in the bucket under `prefix/` (hidden names included; not the empty folder markers pyarrow leaves)."
    c, out = moto.client(), {}
    for o in c.list_objects_v2(Bucket=bucket, Prefix=prefix + '/').get('Contents', []):
        if o['Key'].endswith('/') and o['Size'] == 0: continue
        out[o['Key'][len(prefix) + 1:]] = c.get_object(Bucket=bucket, Key=o['Key'])['Body'].read()
    return out


def test_tokenize_to_s3(text, moto, bucket, tmp_path):
    "`tokenize --out s3://...` puts in the bucket the files a local `--out` gets, byte for byte; the loader reads them back."
    from nanochat_dl.tokens import tokenize
    from nanochat_dl.cli import main
    shards, tok = text
    tok_dir = shards.parent/'tok'
    moto.put(bucket, {})
    res = tokenize(shards, tmp_path/'local', 'toy', tok_dir, workers=2, progress=False, verbose=False)
    assert main(['tokenize', '--data-dir', str(shards), '--out', f's3://{bucket}/tok', '--dataset', 'toy', '--tokenizer-dir', str(tok_dir),
                 '-w', '2', '--no-progress', '--stage-dir', str(tmp_path/'stage')]) == 0
    got = listing(moto, bucket, 'tok')
    assert sorted(got) == ['meta/combined_counts.csv', 'meta/manifest.json'] + [f'toy/{n}' for n in res.done]
    local = tmp_path/'local'
    for k, v in got.items():
        if k.startswith('toy/'): assert v == (local/k).read_bytes(), k
    assert json.loads(got['meta/manifest.json'])['datasets']['toy']['files'] == read_json(local/'meta'/'manifest.json')['datasets']['toy']['files']
    assert got['meta/combined_counts.csv'] == (local/'meta'/'combined_counts.csv').read_bytes()
    same(batches(StreamingLoader(f's3://{bucket}/tok', **KW, cache_dir=tmp_path/'c'), 10), batches(StreamingLoader(local, **KW), 10))
    # a second dataset into the same bucket root keeps the first one's entries
    r2 = tokenize(shards, f's3://{bucket}/tok', 'again', tok_dir, workers=1, split='val', progress=False, verbose=False,
                  stage_dir=tmp_path/'stage2', keep_empty=True)
    assert r2.manifest == f's3://{bucket}/tok/meta/manifest.json'
    m = json.loads(listing(moto, bucket, 'tok')['meta/manifest.json'])
    assert sorted(m['datasets']) == ['again', 'toy']
    assert (m['datasets']['again']['source']['keep_empty'], m['datasets']['toy']['source']['keep_empty']) == (True, False)



def test_tokenize_nested_dataset_names_to_s3(text, moto, bucket, tmp_path):
    "`tokenize --out s3://... --dataset lang=en/dataset=x` puts the objects a local `--out` gets, under the nested name; the loader reads them by that name's weight; a name overlapping one of the bucket's datasets is refused before any work."
    from nanochat_dl.tokens import tokenize
    shards = text[0]
    tok_dir, uri, kw = shards.parent/'tok', f's3://{bucket}/tok', dict(workers=1, progress=False, verbose=False)
    moto.put(bucket, {})
    for ds, split in (('lang=en/dataset=cc', 'train'), ('lang=en/dataset=wiki', 'val')):
        tokenize(shards, tmp_path/'local', ds, tok_dir, split=split, **kw)
        tokenize(shards, uri, ds, tok_dir, split=split, stage_dir=tmp_path/f'stage-{split}', **kw)
    got, local = listing(moto, bucket, 'tok'), tmp_path/'local'
    files = (p.relative_to(local).as_posix() for p in local.rglob('*') if p.is_file())
    assert sorted(got) == sorted(k for k in files if not any(s.startswith('.') for s in k.split('/')))
    assert all(v == (local/k).read_bytes() for k, v in got.items() if k != 'meta/manifest.json')
    m = lambda b: {d: e['files'] for d, e in json.loads(b)['datasets'].items()}
    assert m(got['meta/manifest.json']) == m((local/'meta'/'manifest.json').read_bytes())
    assert sorted(m(got['meta/manifest.json'])) == ['lang=en/dataset=cc', 'lang=en/dataset=wiki']
    w = {'lang=en/dataset=cc': 2, 'lang=en/dataset=wiki': 1}
    same(batches(StreamingLoader(uri, **KW, weights=w, cache_dir=tmp_path/'c'), 10), batches(StreamingLoader(local, **KW, weights=w), 10))
    with pytest.raises(ValueError, match=r"dataset 'lang=en' overlaps dataset 'lang=en/dataset=cc' of s3://"):
        tokenize(shards, uri, 'lang=en', tok_dir, stage_dir=tmp_path/'stage-x', **kw)


def read_json(p): return json.loads(Path(p).read_text())


def test_tokenize_to_s3_never_shows_half_a_file(text, moto, bucket, proxy, tmp_path):
    "Uploads cut by resets and 503s are retried; one the store refuses (403) fails the run: no manifest, no partial object, nothing hidden left over."
    from nanochat_dl.tokens import tokenize
    from nanochat_dl.io.retries import FetchError
    shards, tok = text
    moto.put(bucket, {})
    proxy.add('status', path='.part', method='PUT', count=2, status=503)
    proxy.add('reset', path='.part', method='PUT', count=1, after=0)
    res = tokenize(shards, f's3://{bucket}/ok', 'toy', shards.parent/'tok', workers=1, progress=False, verbose=False, stage_dir=tmp_path/'s1')
    got = listing(moto, bucket, 'ok')
    assert sorted(got) == ['meta/combined_counts.csv', 'meta/manifest.json'] + [f'toy/{n}' for n in res.done]
    assert len([k for k in proxy.requests('.part', 'PUT') if k is not None]) == 3
    proxy.add('status', path='shard_00003.arrow', method='PUT', count=1, status=403)
    with pytest.raises(FetchError, match=re.escape(f"s3://{bucket}/bad/toy/shard_00003.arrow: OSError")):
        tokenize(shards, f's3://{bucket}/bad', 'toy', shards.parent/'tok', workers=1, progress=False, verbose=False, stage_dir=tmp_path/'s2')
    got = listing(moto, bucket, 'bad')
    assert 'meta/manifest.json' not in got and 'toy/shard_00003.arrow' not in got and not [k for k in got if '/.' in '/' + k]


def test_dropin_reads_a_bucket(text, s3text, tmp_path, monkeypatch):
    "nanochat's function names read a bucket given as `data_dir=` or as $NANOCHAT_DL_DATA_DIR, with nanochat's batches."
    from nanochat_dl.dataloader import tokenizing_distributed_data_loader_bos_bestfit as dropin
    shards, tok = text
    kw = dict(tokenizer_threads=1, tokenizer_batch_size=4, device='cpu', buffer_size=8)
    w = dropin(tok, 2, 16, 'train', data_dir=shards, **kw)
    want = [b for b in itertools.islice(w, 12)]; w.close()
    a = dropin(tok, 2, 16, 'train', data_dir=s3text, cache_dir=tmp_path/'c', **kw)
    got = [b for b in itertools.islice(a, 12)]; a.close()
    monkeypatch.setenv('NANOCHAT_DL_DATA_DIR', s3text)
    b = dropin(tok, 2, 16, 'train', cache_dir=tmp_path/'c2', cache_size=10**6, **kw)
    env = [x for x in itertools.islice(b, 12)]
    assert b.loader.cache.cache_size == 10**6; b.close()
    for (x0, y0), (x1, y1), (x2, y2) in zip(want, got, env): assert torch.equal(x0, x1) and torch.equal(y0, y1) and torch.equal(x0, x2)


def test_tokenize_from_s3_shards(text, s3text, moto, tmp_path):
    "`tokenize --data-dir s3://...` reads the shards through the cache: the token files are those of the local shards, the manifest names the URI."
    from nanochat_dl.tokens import read_manifest, tokenize
    from nanochat_dl.cli import main
    shards, tok = text
    tokenize(shards, tmp_path/'local', 'toy', shards.parent/'tok', workers=1, split='all', progress=False, verbose=False)
    assert main(['tokenize', '--data-dir', s3text, '--out', str(tmp_path/'remote'), '--dataset', 'toy', '--tokenizer-dir', str(shards.parent/'tok'),
                 '-w', '1', '--split', 'all', '--no-progress', '--cache-dir', str(tmp_path/'c'), '--cache-size', '1000000']) == 0
    for p in sorted((tmp_path/'local'/'toy').glob('*.arrow')): assert p.read_bytes() == (tmp_path/'remote'/'toy'/p.name).read_bytes()
    assert read_manifest(tmp_path/'remote')['datasets']['toy']['source']['data_dir'] == s3text
    assert sorted(p.name for p in (tmp_path/'c'/'files').iterdir()) == sorted(p.name for p in shards.glob('*.parquet'))


def test_nested_dataset_names_from_s3(moto, bucket, tmp_path):
    "fms-fsdp's layout in a bucket (issue 19, section 7): the datasets the local root lists, by the same rule, and the same batches."
    local, names = tmp_path/'nested', ['lang=en/dataset=commoncrawl', 'lang=en/dataset=wiki', 'web']
    for k, ds in enumerate(names): write_token_file(local/ds/'part_0.arrow', [[10 * k + i + 2] * (1 + i % 3) for i in range(12)])
    moto.put(bucket, objects(local, 'tokens'))
    uri = f's3://{bucket}/tokens'
    with TokenRoot(uri, cache_dir=tmp_path/'c') as tr: assert tr.datasets == names
    w = {'lang=en/dataset=commoncrawl': 2, 'lang=en/dataset=wiki': 1}
    kw = dict(KW, datasets=list(w), weights=w)
    got, want = batches(StreamingLoader(uri, **kw, cache_dir=tmp_path/'c2'), 10), batches(StreamingLoader(local, **kw), 10)
    assert all(np.array_equal(a[0], b[0]) and a[1]['datasets'] == b[1]['datasets'] for a, b in zip(got, want))   # (no manifest: digests differ)
    with pytest.raises(ValueError, match=r"unknown dataset\(s\) \['lang=fr'\]"): StreamingLoader(uri, **dict(KW, datasets=['lang=fr']), cache_dir=tmp_path/'c3')
    with TokenRoot(uri, ['lang=en'], cache_dir=tmp_path/'c4') as tr: assert [i.file for i in tr.files['lang=en']] == ['dataset=commoncrawl/part_0.arrow', 'dataset=wiki/part_0.arrow']


def test_closing_one_loader_leaves_another_on_the_same_remote_root_reading(local, s3root, tmp_path):
    "Two loaders on one `TokenRoot` over a bucket: closing one cancels no fetch of the other (only the last user's close does)."
    want = batches(StreamingLoader(local, **KW), 30)
    tr = TokenRoot(s3root, cache_dir=tmp_path/'c', prefetch=0, fetch=FAST, max_open=1)   # files mapped again and again
    a, b = StreamingLoader(tr, **KW), StreamingLoader(tr, **KW)
    first = [next(b) for _ in range(2)]
    a.close()
    got = [(x.rows.copy(), json.loads(json.dumps(x.state))) for x in first] + batches(b, 28)
    same(got, want)
    tr.close()


def test_cache_sized_below_a_ranks_share_refetches(moto, bucket, tmp_path):
    "Rank 0 of 2 reads a bucket exactly as local disk through a cache with room for its share (each file fetched once) and through one with room for two files, which fetches more than ten times the data (from the file cache chapter, `nbs/io/01d_cache.ipynb`)."
    troot, rng = tmp_path/'troot', np.random.default_rng(1)
    for ds, names in {'web': ['a.arrow', 'b.arrow', 'c.arrow'], 'code': ['x.arrow']}.items():
        recs = {}
        for f in names:
            write_token_file(troot/ds/f, [rng.integers(3, 1000, n) for n in rng.integers(0, 300, 150)])
            recs[f] = file_record(troot/ds/f)
        update_counts(troot, ds, {f: (r.documents, r.tokens) for f, r in recs.items()})
        update_manifest(troot, ds, recs)
    moto.put(bucket, objects(troot, 'troot'))
    sizes = sorted(q.stat().st_size for q in troot.rglob('*.arrow'))
    kw = dict(seq_len=256, batch_size=4, bos_token=1, shuffle_window=100, prefetch=0, rank=0, world_size=2)

    def from_bucket(cap, n=100):
        "The same batches and states from the bucket (a cache capped at `cap` bytes) as from local disk; the cache's counters."
        local = StreamingLoader(troot, **kw)
        remote = StreamingLoader(f's3://{bucket}/troot', **kw, cache_dir=tmp_path/f'cache{cap}', cache_size=cap)
        try:
            for _ in range(n):
                a, b = next(local), next(remote)
                assert np.array_equal(a.rows, b.rows) and a.state == b.state
            assert a.metrics['cache'] is None                                 # local data: no cache
            return b.metrics['cache']
        finally: local.close(); remote.close()

    share, tight = from_bucket(sum(sizes[-3:])), from_bucket(sum(sizes[-2:]))
    assert share['fetched_bytes'] < sum(sizes) and share['cached_bytes'] <= sum(sizes[-3:])   # no token file fetched twice
    assert tight['evictions'] > 0 and tight['fetched_bytes'] > 10 * sum(sizes) and tight['cached_bytes'] <= sum(sizes[-2:])
