"""Download path of nanochat_dl.text.dataset against a real HTTP server on 127.0.0.1 with injected faults:
retries, resume with Range and If-Range, files re-uploaded between requests, servers that ignore Range
or If-Range, HTML pages served as 200, short, changed and trickling bodies, 404s, skipping valid files,
the parallel `download` summary, Ctrl-C on a real process, the folder lock between real processes
(download and sample), stale temp files, and the CLI exit codes."""
import hashlib, os, shutil, socket, time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nanochat_dl.core import LOCK_FILE

from nanochat_dl.testing import ShardServer
from nanochat_dl.text.dataset import BASE_URL_ENV, SOURCE_FILE, DownloadResult, download, download_cli, download_single_file
from nanochat_dl.text.sample import make_sample_shards, sample_cli, shard_summary

FAST = dict(backoff=0.001, timeout=5)        # keep retries quick
NAMES = [f'shard_{i:05d}.parquet' for i in range(4)]


def sha(path): return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def listing(folder):
    "Everything in `folder` but its dataset marker and its lock file."
    return sorted(f for f in os.listdir(folder) if f not in (SOURCE_FILE, LOCK_FILE)) if Path(folder).exists() else []


def leftovers(folder):
    "Files in `folder` that are not finished shards (temp files, partial downloads)."
    return [f for f in listing(folder) if not f.endswith('.parquet')]


@pytest.fixture(scope='module')
def served(tmp_path_factory):
    "Four real shards (text column, row groups of 100 docs), each a few hundred KiB so bodies arrive in many reads."
    d = tmp_path_factory.mktemp('served')
    for i, name in enumerate(NAMES):
        docs = [f'shard {i} document {j}: ' + ' '.join(str(j * k + i) for k in range(60)) for j in range(2000)]
        pq.write_table(pa.table({'text': docs}), d/name, row_group_size=100, compression='none')
    return d


@pytest.fixture
def server(served):
    with ShardServer(served) as srv: yield srv


@pytest.fixture
def norange_server(served):
    with ShardServer(served, ranges=False) as srv: yield srv


def test_clean_download_is_byte_identical(server, served, tmp_path):
    res = download(4, workers=4, data_dir=tmp_path, base_url=server.url, progress=False, verbose=False, **FAST)
    assert [(r.index, r.status, r.ok, r.attempts) for r in res] == [(i, 'downloaded', True, 1) for i in range(4)]
    assert [sha(tmp_path/n) for n in NAMES] == [sha(served/n) for n in NAMES]
    assert [r.bytes for r in res] == [(served/n).stat().st_size for n in NAMES]
    assert leftovers(tmp_path) == []
    umask = os.umask(0); os.umask(umask)
    assert {(tmp_path/n).stat().st_mode & 0o777 for n in NAMES} == {0o666 & ~umask}   # readable by other ranks' users


def test_5xx_are_retried_then_succeed(server, served, tmp_path):
    server.fail(NAMES[1], 500, 500, 503)
    r = download_single_file(1, tmp_path, base_url=server.url, **FAST)
    assert (r.ok, r.status, r.attempts) == (True, 'downloaded', 4)
    assert [q['fault'] for q in server.requests_for(NAMES[1])] == [500, 500, 503, None]
    assert sha(tmp_path/NAMES[1]) == sha(served/NAMES[1])


def test_429_is_retried(server, tmp_path):
    server.fail(NAMES[0], 429)
    r = download_single_file(0, tmp_path, base_url=server.url, **FAST)
    assert r.ok and len(server.requests_for(NAMES[0])) == 2


def test_5xx_exhausted_fails_cleanly(server, tmp_path):
    server.fail(NAMES[2], *[500] * 10)
    r = download_single_file(2, tmp_path, base_url=server.url, max_retries=2, **FAST)
    assert (r.ok, r.status, r.bytes, r.attempts) == (False, 'failed', 0, 3)
    assert len(server.requests_for(NAMES[2])) == 3
    assert NAMES[2] in r.error and f'{server.url}/{NAMES[2]}' in r.error and 'HTTP 500' in r.error, r.error
    assert listing(tmp_path) == []


def test_dropped_connection_resumes_with_range(server, served, tmp_path):
    size = (served/NAMES[0]).stat().st_size
    server.fail(NAMES[0], 'drop')
    r = download_single_file(0, tmp_path, base_url=server.url, **FAST)
    assert (r.ok, r.attempts, r.bytes) == (True, 2, size)
    assert [q['range'] for q in server.requests_for(NAMES[0])] == [None, f'bytes={size // 2}-']
    assert sha(tmp_path/NAMES[0]) == sha(served/NAMES[0])
    assert leftovers(tmp_path) == []


def test_two_drops_resume_twice(server, served, tmp_path):
    size = (served/NAMES[3]).stat().st_size
    server.fail(NAMES[3], 'drop', 'drop')
    r = download_single_file(3, tmp_path, base_url=server.url, **FAST)
    first = size // 2
    second = first + (size - first) // 2
    assert r.ok and [q['range'] for q in server.requests_for(NAMES[3])] == [None, f'bytes={first}-', f'bytes={second}-']
    assert sha(tmp_path/NAMES[3]) == sha(served/NAMES[3])


def test_drop_without_range_support_restarts(norange_server, served, tmp_path):
    norange_server.fail(NAMES[1], 'drop')
    r = download_single_file(1, tmp_path, base_url=norange_server.url, **FAST)
    assert r.ok and [q['range'] for q in norange_server.requests_for(NAMES[1])] == [None, None]
    assert sha(tmp_path/NAMES[1]) == sha(served/NAMES[1])


def test_server_ignoring_range_restarts_from_scratch(server, served, tmp_path):
    "It said Accept-Ranges, then answered our Range request with 200 and the whole file: no bytes may be doubled."
    size = (served/NAMES[2]).stat().st_size
    server.fail(NAMES[2], 'drop', 'ignore_range')
    r = download_single_file(2, tmp_path, base_url=server.url, **FAST)
    assert [q['range'] for q in server.requests_for(NAMES[2])] == [None, f'bytes={size // 2}-']
    assert (r.ok, r.bytes) == (True, size)
    assert sha(tmp_path/NAMES[2]) == sha(served/NAMES[2])


def test_short_body_once_is_completed_by_range(server, served, tmp_path):
    size = (served/NAMES[0]).stat().st_size
    server.fail(NAMES[0], 'short')
    r = download_single_file(0, tmp_path, base_url=server.url, **FAST)
    assert r.ok and [q['range'] for q in server.requests_for(NAMES[0])] == [None, f'bytes={size - size // 10}-']
    assert sha(tmp_path/NAMES[0]) == sha(served/NAMES[0])


def test_short_body_every_time_is_rejected(norange_server, served, tmp_path):
    size = (served/NAMES[1]).stat().st_size
    norange_server.fail(NAMES[1], *['short'] * 10)
    r = download_single_file(1, tmp_path, base_url=norange_server.url, max_retries=2, **FAST)
    assert (r.ok, r.status, r.attempts) == (False, 'failed', 3)
    assert NAMES[1] in r.error and norange_server.url in r.error
    assert f'after {size - size // 10} of {size} bytes expected' in r.error, r.error
    assert listing(tmp_path) == []


def test_404_fails_at_once_and_leaves_nothing(server, tmp_path):
    r = download_single_file(7, tmp_path, base_url=server.url, **FAST)
    assert (r.ok, r.status, r.bytes, r.attempts) == (False, 'failed', 0, 1)
    assert 'shard_00007.parquet' in r.error and 'HTTP 404' in r.error and 'expected 200' in r.error, r.error
    assert len(server.requests_for('shard_00007.parquet')) == 1
    assert listing(tmp_path) == []


def test_html_page_with_status_200_never_becomes_a_shard(server, tmp_path):
    server.fail(NAMES[3], *['html'] * 10)
    r = download_single_file(3, tmp_path, base_url=server.url, max_retries=2, **FAST)
    assert (r.ok, r.status, r.attempts) == (False, 'failed', 3)
    assert NAMES[3] in r.error and 'not a readable parquet file' in r.error and "b'<!DOCTYPE html>" in r.error, r.error
    assert listing(tmp_path) == []


def test_valid_existing_file_is_skipped_without_a_request(server, served, tmp_path):
    shutil.copy(served/NAMES[0], tmp_path)
    r = download_single_file(0, tmp_path, base_url=server.url, **FAST)
    assert (r.ok, r.status, r.attempts, r.bytes) == (True, 'skipped', 0, (served/NAMES[0]).stat().st_size)
    assert server.requests_for(NAMES[0]) == []


@pytest.mark.parametrize('garbage', [b'', b'<html>oops</html>', 'cut'])
def test_invalid_existing_file_is_downloaded_again(server, served, tmp_path, garbage):
    data = (served/NAMES[1]).read_bytes()
    (tmp_path/NAMES[1]).write_bytes(data[:len(data) // 3] if garbage == 'cut' else garbage)
    r = download_single_file(1, tmp_path, base_url=server.url, **FAST)
    assert (r.ok, r.status) == (True, 'downloaded')
    assert sha(tmp_path/NAMES[1]) == sha(served/NAMES[1])


def test_invalid_existing_file_is_removed_when_the_download_fails(server, tmp_path):
    (tmp_path/NAMES[2]).write_bytes(b'junk')
    server.fail(NAMES[2], *['html'] * 10)
    r = download_single_file(2, tmp_path, base_url=server.url, max_retries=2, **FAST)
    assert not r.ok and listing(tmp_path) == []


def test_connection_refused_names_file_and_url(tmp_path):
    with socket.socket() as s:                    # a port held (bound, not listening) so that nothing else can listen on it
        s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
        t0 = time.time()
        r = download_single_file(0, tmp_path, base_url=f'http://127.0.0.1:{port}', max_retries=2, **FAST)
    assert (r.ok, r.status, r.attempts) == (False, 'failed', 3)
    assert f'shard_00000.parquet from http://127.0.0.1:{port}/shard_00000.parquet' in r.error, r.error
    assert time.time() - t0 < 10 and listing(tmp_path) == []


def test_stalled_server_times_out_and_is_retried(served, tmp_path):
    with ShardServer(served, stall_s=1.5) as srv:
        srv.fail(NAMES[0], 'stall')
        t0 = time.time()
        r = download_single_file(0, tmp_path, base_url=srv.url, timeout=0.3, backoff=0.001)
        assert (r.ok, r.attempts) == (True, 2) and time.time() - t0 < 1.4
        assert len(srv.requests_for(NAMES[0])) == 2


def test_base_url_from_environment(server, served, tmp_path, monkeypatch):
    monkeypatch.setenv(BASE_URL_ENV, server.url + '/')
    r = download_single_file(0, tmp_path, **FAST)
    assert r.ok and r.url == f'{server.url}/{NAMES[0]}' and sha(tmp_path/NAMES[0]) == sha(served/NAMES[0])


def test_progress_callbacks_add_up_through_a_restart(norange_server, served, tmp_path):
    size, got, sizes = (served/NAMES[3]).stat().st_size, [], []
    norange_server.fail(NAMES[3], 'drop')
    r = download_single_file(3, tmp_path, base_url=norange_server.url, on_bytes=got.append, on_size=sizes.append, **FAST)
    assert r.ok and sizes == [size] and sum(got) == size and min(got) == -(size // 2)   # the dropped half is taken back


def test_index_out_of_range_is_an_argument_error(tmp_path):
    with pytest.raises(ValueError, match=r"shard index 1823 is out of range for preset 'fineweb-edu-100b': expected 0..1822"):
        download_single_file(1823, tmp_path, base_url='http://127.0.0.1:9')


def test_download_summary_lists_failures(server, served, tmp_path, capsys):
    server.fail(NAMES[1], *['html'] * 6).fail(NAMES[2], 503)         # 1 + max_retries=5 HTML pages
    res = download(5, workers=3, data_dir=tmp_path, base_url=server.url, progress=False, **FAST)
    assert [r.status for r in res] == ['downloaded', 'failed', 'downloaded', 'downloaded', 'failed']
    assert all(isinstance(r, DownloadResult) for r in res)
    out = capsys.readouterr().out
    assert '3 downloaded' in out and '2 failed, of 5 shards' in out
    assert 'FAILED (2): shard_00001.parquet, shard_00004.parquet' in out
    assert 'shard_00004.parquet from' in out and 'HTTP 404' in out and 'not a readable parquet file' in out
    assert leftovers(tmp_path) == []
    assert listing(tmp_path) == [NAMES[0], NAMES[2], NAMES[3]]


def test_download_of_many_with_faults_everywhere(server, served, tmp_path):
    for name, faults in zip(NAMES, [('drop',), (500, 'short'), ('drop', 'ignore_range'), (502, 'drop', 'drop')]):
        server.fail(name, *faults)
    res = download(4, workers=4, data_dir=tmp_path, base_url=server.url, progress=True, verbose=False, **FAST)
    assert all(r.ok for r in res), [r.error for r in res]
    assert [sha(tmp_path/n) for n in NAMES] == [sha(served/n) for n in NAMES]
    assert leftovers(tmp_path) == []


def test_cli_exit_codes(server, tmp_path, capsys):
    args = dict(data_dir=str(tmp_path), base_url=server.url, progress=False)
    assert download_cli(Num_files=5, Workers=2, **args) == 1                 # shard 4 does not exist
    assert 'FAILED (1): shard_00004.parquet' in capsys.readouterr().out
    assert download_cli(Num_files=4, Workers=2, **args) == 0                 # all present: skipped
    assert '0 downloaded (0 B), 4 skipped, 0 failed' in capsys.readouterr().out
    assert [len(server.requests_for(n)) for n in NAMES] == [1, 1, 1, 1]
    assert download_cli(Num_files=-3, **args) == 2
    assert 'got -3' in capsys.readouterr().err
    assert download_cli(Num_files=2, preset='nope', **args) == 2


def test_cli_parses_short_flags(server, served, tmp_path):
    from nanochat_dl.cli import main
    rc = main(['download', '-n', '2', '-w', '2', '--base-url', server.url, '--data-dir', str(tmp_path), '--no-progress'])
    assert rc == 0 and listing(tmp_path) == NAMES[:2]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(faults=st.lists(st.sampled_from([500, 503, 'drop', 'short', 'ignore_range', 'stall', 'html', 'flip', 'trickle']),
                      max_size=3),
       ranges=st.booleans(), validators=st.booleans())
def test_any_few_transient_faults_end_in_the_exact_file(served, tmp_path_factory, faults, ranges, validators):
    "With at most max_retries transient faults the shard always arrives intact; nothing else is left behind."
    dest = tmp_path_factory.mktemp('dest')
    with ShardServer(served, ranges=ranges, stall_s=0.0, etag=validators, last_modified=validators, sha256=True) as srv:
        srv.fail(NAMES[2], *faults)
        r = download_single_file(2, dest, base_url=srv.url, max_retries=3, **FAST)
    assert r.ok, r.error
    assert sha(dest/NAMES[2]) == sha(served/NAMES[2]) and listing(dest) == [NAMES[2]]


def test_sample_cli_writes_and_summarises(tmp_path, capsys):
    assert sample_cli(data_dir=str(tmp_path), n_shards=3) == 0
    out = capsys.readouterr().out
    summ = shard_summary(tmp_path)
    assert [s.name for s in summ] == NAMES[:3] and 'shard_00002.parquet (val)' in out
    assert all(s.row_groups >= 5 for s in summ)
    before = [sha(tmp_path/n) for n in NAMES[:3]]
    make_sample_shards(tmp_path, n_shards=3, overwrite=True)
    assert [sha(tmp_path/n) for n in NAMES[:3]] == before


def test_without_read1_a_drop_still_ends_in_the_exact_file(server, served, tmp_path, monkeypatch):
    "Older urllib3 has no `read1`: the body is read with iter_content and a cut may lose the last chunk, never correctness."
    import urllib3.response
    monkeypatch.setattr(urllib3.response.HTTPResponse, 'read1', None)   # what _body_chunks sees there
    server.fail(NAMES[0], 'drop', 'short')
    r = download_single_file(0, tmp_path, base_url=server.url, chunk_size=1 << 16, **FAST)
    assert r.ok and sha(tmp_path/NAMES[0]) == sha(served/NAMES[0]) and listing(tmp_path) == [NAMES[0]]


def test_one_folder_one_dataset(server, tmp_path, capsys):
    "Real shards are never 'skipped' into a folder of sample shards (same names, different data), nor vice versa."
    make_sample_shards(tmp_path/'s', n_shards=2)
    assert download_cli(Num_files=2, data_dir=str(tmp_path/'s'), base_url=server.url, progress=False) == 2
    assert "already holds 'sample' shards" in capsys.readouterr().err
    assert server.log == []
    assert download_cli(Num_files=1, data_dir=str(tmp_path/'f'), base_url=server.url, progress=False) == 0
    assert sample_cli(data_dir=str(tmp_path/'f')) == 2
    assert download_cli(Num_files=1, preset='climbmix-400b', data_dir=str(tmp_path/'f'), base_url=server.url) == 2
    assert "already holds 'fineweb-edu-100b' shards" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Hardening: a file that changes between requests, bodies that fail validation, stalls, Ctrl-C, two writers
# of one folder, stale temp files, and arguments the CLI must refuse.

import signal, subprocess, sys

CHILD = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
         "from nanochat_dl.cli import main; sys.exit(main(sys.argv[1:]))")


def new_version(served, name):
    "Another version of shard `name`: the same shape, other documents, another size."
    docs = [f'version 2 of {name}, document {j}: ' + ' '.join(str(7 * j + k) for k in range(55)) for j in range(2100)]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({'text': docs}), sink, row_group_size=100, compression='none')
    data = sink.getvalue().to_pybytes()
    assert data != (served/name).read_bytes()
    return data


def wait_for(cond, what, limit=30.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit: raise AssertionError(f'gave up waiting for {what}')
        time.sleep(0.05)


def test_a_file_changed_between_requests_is_fetched_again_not_spliced(server, served, tmp_path):
    "The resume names the version it holds (If-Range: ETag); the host answers 200 with the new file, which is kept whole."
    v2 = new_version(served, NAMES[0])
    server.fail(NAMES[0], 'drop').swap(NAMES[0], v2, after=1)
    r = download_single_file(0, tmp_path, base_url=server.url, **FAST)
    assert r.ok, r.error
    assert (tmp_path/NAMES[0]).read_bytes() == v2
    log = server.requests_for(NAMES[0])
    etag1 = '"' + sha(served/NAMES[0])[:32] + '"'
    assert [(q['range'] is not None, q['if_range']) for q in log] == [(False, None), (True, etag1)]
    assert r.bytes == len(v2) and leftovers(tmp_path) == []


def test_a_resume_of_the_same_version_names_it(server, served, tmp_path):
    size = (served/NAMES[0]).stat().st_size
    server.fail(NAMES[0], 'drop')
    r = download_single_file(0, tmp_path, base_url=server.url, **FAST)
    assert r.ok and sha(tmp_path/NAMES[0]) == sha(served/NAMES[0])
    assert [(q['range'], q['if_range']) for q in server.requests_for(NAMES[0])] == \
        [(None, None), (f'bytes={size // 2}-', '"' + sha(served/NAMES[0])[:32] + '"')]


def test_if_range_falls_back_to_last_modified(served, tmp_path):
    v2 = new_version(served, NAMES[1])
    with ShardServer(served, etag=False) as srv:
        srv.fail(NAMES[1], 'drop').swap(NAMES[1], v2, after=1)
        r = download_single_file(1, tmp_path, base_url=srv.url, **FAST)
        log = srv.requests_for(NAMES[1])
    assert r.ok and (tmp_path/NAMES[1]).read_bytes() == v2
    assert log[1]['range'] is not None and log[1]['if_range'].endswith(' GMT'), log


def test_without_a_validator_a_broken_body_starts_over(served, tmp_path):
    "A host that names no version cannot be resumed safely: the second request asks for the whole file."
    v2 = new_version(served, NAMES[2])
    with ShardServer(served, etag=False, last_modified=False) as srv:
        srv.fail(NAMES[2], 'drop').swap(NAMES[2], v2, after=1)
        r = download_single_file(2, tmp_path, base_url=srv.url, **FAST)
        log = srv.requests_for(NAMES[2])
    assert r.ok and (tmp_path/NAMES[2]).read_bytes() == v2
    assert [q['range'] for q in log] == [None, None]


def test_a_host_ignoring_if_range_is_caught_by_the_changed_etag(served, tmp_path):
    "A proxy that answers the Range from the new file (206) gives itself away by its ETag: start over."
    v2 = new_version(served, NAMES[3])
    with ShardServer(served, if_range=False) as srv:
        srv.fail(NAMES[3], 'drop').swap(NAMES[3], v2, after=1)
        r = download_single_file(3, tmp_path, base_url=srv.url, **FAST)
        log = srv.requests_for(NAMES[3])
    assert r.ok, r.error
    assert (tmp_path/NAMES[3]).read_bytes() == v2
    assert [q['range'] is not None for q in log] == [False, True, False]


def test_published_sha256_rejects_a_changed_byte(served, tmp_path):
    "With Hugging Face's X-Linked-Etag (the sha256) a body with one byte changed is refused and fetched again."
    with ShardServer(served, sha256=True) as srv:
        srv.fail(NAMES[0], 'flip')
        r = download_single_file(0, tmp_path, base_url=srv.url, **FAST)
        assert r.ok and r.attempts == 2 and sha(tmp_path/NAMES[0]) == sha(served/NAMES[0])
        srv.fail(NAMES[1], 'flip', 'flip', 'flip')
        r = download_single_file(1, tmp_path, base_url=srv.url, max_retries=2, **FAST)
    assert not r.ok and r.error.count(f'sha256 is not the {sha(served/NAMES[1])} the host published') == 3, r.error
    assert listing(tmp_path) == [NAMES[0]]


def test_a_transient_html_page_is_retried(server, served, tmp_path):
    server.fail(NAMES[2], 'html')
    r = download_single_file(2, tmp_path, base_url=server.url, **FAST)
    assert (r.ok, r.status, r.attempts) == (True, 'downloaded', 2), r.error
    assert sha(tmp_path/NAMES[2]) == sha(served/NAMES[2])


def test_the_final_error_says_what_each_try_received(norange_server, served, tmp_path):
    size = (served/NAMES[1]).stat().st_size
    norange_server.fail(NAMES[1], 'html', 'short', 'html')
    r = download_single_file(1, tmp_path, base_url=norange_server.url, max_retries=2, **FAST)
    assert (r.ok, r.attempts) == (False, 3)
    head, *parts = r.error.split('; request ')
    assert head == f'{NAMES[1]} from {norange_server.url}/{NAMES[1]}: gave up after 3 requests' and len(parts) == 3, r.error
    assert parts[0].startswith('1: rejected the 88 bytes received') and "b'<!DOCTYPE html>" in parts[0]
    assert parts[1].startswith('2: ') and f'after {size - size // 10} of {size} bytes expected' in parts[1]
    assert parts[2].startswith('3: ') and 'not a readable parquet file' in parts[2]
    assert listing(tmp_path) == []


def test_a_trickling_server_is_bounded_by_the_timeout(served, tmp_path):
    "One byte every 0.2 s never trips a per-read timeout; --timeout bounds the stalled transfer as a whole."
    with ShardServer(served, stall_s=20, trickle_s=0.2) as srv:
        srv.fail(NAMES[0], 'trickle', 'trickle')
        t0 = time.monotonic()
        r = download_single_file(0, tmp_path, base_url=srv.url, timeout=1, max_retries=1, backoff=0.001)
        dt = time.monotonic() - t0
    assert not r.ok and r.error.count('stalled') == 2, r.error
    assert dt < 12, dt                       # two tries of about a second each; unbounded, it takes 40 s
    assert listing(tmp_path) == []


@pytest.mark.parametrize('fault', ['stall', 'trickle'])
def test_ctrl_c_stops_a_download_promptly(served, tmp_path, fault):
    "SIGINT to `nanochat-dl download` with transfers hanging or trickling: exit 130 within seconds, no partial files."
    with ShardServer(served, stall_s=60, trickle_s=0.2) as srv:
        for n in NAMES[:2]: srv.fail(n, fault)
        proc = subprocess.Popen([sys.executable, '-c', CHILD, 'download', '-n', '2', '-w', '2', '--base-url', srv.url,
                                 '--data-dir', str(tmp_path), '--no-progress', '--timeout', '30'],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: len(srv.log) >= 2, 'both requests')
            if fault == 'trickle': wait_for(lambda: any(f.endswith('.tmp') for f in os.listdir(tmp_path)), 'a partial file')
            time.sleep(0.5)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            try: out, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired: proc.kill(); proc.communicate(); pytest.fail('still running 20 s after Ctrl-C')
            dt = time.monotonic() - t0
        finally:
            if proc.poll() is None: proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert dt < 10, dt
    assert 'interrupted' in err and 'Traceback' not in err, err
    assert listing(tmp_path) == []


RACER = """
import os, sys, time
import nanochat_dl.text.sample as ds
folder, n, delay, go = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
write = ds._write_shard
def slow_write(*a, **k): time.sleep(delay); return write(*a, **k)   # widen the window a race needs
ds._write_shard = slow_write
while not os.path.exists(go): time.sleep(0.005)
sys.exit(ds.sample_cli(data_dir=folder, n_shards=n))
"""


def test_racing_sample_runs_leave_one_split(tmp_path):
    "Two `sample` runs with different --n-shards at once: one wins, the other refuses; the folder holds one split."
    from nanochat_dl.text.dataset import list_parquet_files
    from nanochat_dl.text.sample import sample_shard_documents
    folder, go = tmp_path/'data', tmp_path/'go'
    procs = {n: subprocess.Popen([sys.executable, '-c', RACER, str(folder), str(n), str(delay), str(go)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n, delay in [(3, 0.4), (5, 0.1)]}
    time.sleep(1.0); go.touch()
    res = {n: (p.wait(timeout=120), p.stderr.read()) for n, p in procs.items()}
    assert sorted(rc for rc, _ in res.values()) == [0, 2], res
    winner = next(n for n, (rc, _) in res.items() if rc == 0)
    loser_err = next(err for rc, err in res.values() if rc == 2)
    assert loser_err.startswith('nanochat-dl sample: error: ') and len(loser_err.splitlines()) == 1, loser_err
    texts = [pq.read_table(f).column('text').to_pylist() for f in list_parquet_files(folder)]
    assert texts == sample_shard_documents(winner)
    for n in (3, 5):                                           # later runs see it too
        assert sample_cli(data_dir=str(folder), n_shards=n) == (0 if n == winner else 2)


def test_sample_checks_the_split_even_when_no_shard_is_missing(tmp_path, capsys):
    "A complete set of 5 whose shard 1 came from a 3-shard split is refused, not trusted."
    make_sample_shards(tmp_path/'five', n_shards=5)
    make_sample_shards(tmp_path/'three', n_shards=3)
    shutil.copy(tmp_path/'three'/NAMES[1], tmp_path/'five'/NAMES[1])
    assert sample_cli(data_dir=str(tmp_path/'five'), n_shards=5) == 2
    assert 'shard_00001.parquet holds' in capsys.readouterr().err


def test_stale_temp_files_are_removed(server, tmp_path):
    stale = [NAMES[0] + '.0123abcd.tmp', NAMES[3] + '.89abcdef.tmp', SOURCE_FILE + '.00ff00ff.tmp']
    for f in stale + ['notes.tmp']: (tmp_path/f).write_bytes(b'partial')
    assert download_cli(Num_files=1, data_dir=str(tmp_path), base_url=server.url, progress=False) == 0
    assert listing(tmp_path) == ['notes.tmp', NAMES[0]]       # ours removed, someone else's kept
    (tmp_path/'s').mkdir(); (tmp_path/'s'/stale[1]).write_bytes(b'partial')
    make_sample_shards(tmp_path/'s', n_shards=2)
    assert listing(tmp_path/'s') == NAMES[:2]


HOLDER = """
import os, sys, shutil
from pathlib import Path
from nanochat_dl.core import folder_lock
folder, src = Path(sys.argv[1]), sys.argv[2]
with folder_lock(folder):
    tmp = folder/'shard_00000.parquet.a1b2c3d4.tmp'
    shutil.copy(src, tmp)
    print('locked', flush=True)
    sys.stdin.readline()                               # hold the lock until the test says so
    os.replace(tmp, folder/'shard_00000.parquet')      # a live writer's temp file must still be there
"""


def holder(tmp_path, served):
    "A process holding `tmp_path`'s lock while it writes shard 0; a line on its stdin lets it finish."
    proc = subprocess.Popen([sys.executable, '-c', HOLDER, str(tmp_path), str(served/NAMES[0])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.stdout.readline() != 'locked\n': proc.kill(); pytest.fail(f"the lock holder did not start: {proc.communicate()[1]}")
    return proc


def let_go(proc):
    proc.stdin.write('\n'); proc.stdin.flush()


def test_a_live_writers_temp_file_is_left_alone(server, served, tmp_path, monkeypatch):
    "Another process holds the folder's lock and is writing: download waits for it, and keeps its temp file."
    import threading
    import nanochat_dl.core as core
    monkeypatch.setattr(core, 'LOCK_WAIT_S', 120.0)            # the bound on the wait, not what is tested
    busy, take = threading.Event(), core._take
    def watched(key, fd):                                      # the holder goes on once download has found the lock taken
        got = take(key, fd)
        if got is None: busy.set()
        return got
    monkeypatch.setattr(core, '_take', watched)
    proc = holder(tmp_path, served)
    try:
        threading.Thread(target=lambda: busy.wait(120) and let_go(proc), daemon=True).start()
        rc = download_cli(Num_files=2, data_dir=str(tmp_path), base_url=server.url, progress=False)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None: proc.kill()
    assert busy.is_set() and rc == 0 and listing(tmp_path) == NAMES[:2]
    assert server.requests_for(NAMES[0]) == []                 # waited, then found the other writer's shard


def test_a_busy_folder_is_refused_after_a_bounded_wait(served, tmp_path, capsys, monkeypatch):
    import nanochat_dl.core as core
    monkeypatch.setattr(core, 'LOCK_WAIT_S', 0.3)
    proc = holder(tmp_path, served)
    try:
        assert sample_cli(data_dir=str(tmp_path), n_shards=2) == 2
        err = capsys.readouterr().err
        let_go(proc)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None: proc.kill()
    assert err.startswith(f'nanochat-dl sample: error: {tmp_path} is being written by another process (pid {proc.pid}')
    assert len(err.splitlines()) == 1, err


def test_a_download_that_fetched_nothing_leaves_the_folder_unmarked(server, tmp_path):
    from nanochat_dl.text.dataset import data_dir_source
    assert download_cli(Num_files=6, data_dir=str(tmp_path), base_url=server.url + '/nothing-here', progress=False) == 1
    assert data_dir_source(tmp_path) is None and listing(tmp_path) == []
    assert sample_cli(data_dir=str(tmp_path), n_shards=2) == 0              # still free for any dataset
    assert data_dir_source(tmp_path) == 'sample'


def test_negative_max_retries_is_refused(server, tmp_path, capsys):
    from nanochat_dl.cli import main
    assert main(['download', '-n', '1', '--max-retries', '-1', '--base-url', server.url, '--data-dir', str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == 'nanochat-dl download: error: --max-retries=-1 is invalid: expected an int >= 0\n', err
    assert server.log == []


@pytest.mark.parametrize('cmd', ['download', 'sample'])
def test_an_unusable_data_dir_is_a_one_line_error(server, tmp_path, capsys, cmd):
    "A name the file system refuses (longer than 255 bytes), even for root: exit 2 and one line, no traceback."
    from nanochat_dl.cli import main
    bad = tmp_path/('x' * 300)/'data'
    extra = ['--base-url', server.url, '--no-progress'] if cmd == 'download' else []
    assert main([cmd, '--data-dir', str(bad), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'nanochat-dl {cmd}: error: {bad}') and 'File name too long' in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize('cmd', ['download', 'sample'])
def test_a_data_dir_under_an_unreadable_folder_is_a_one_line_error(server, tmp_path, capsys, cmd):
    from nanochat_dl.cli import main
    locked = tmp_path/'locked'; locked.mkdir(); locked.chmod(0)
    try:
        try: os.listdir(locked)
        except PermissionError: pass
        else: pytest.skip('this process reads a mode-000 folder (root, or CAP_DAC_OVERRIDE): permissions cannot make the path unusable')
        extra = ['--base-url', server.url, '--no-progress'] if cmd == 'download' else []
        assert main([cmd, '--data-dir', str(locked/'data'), *extra]) == 2
    finally: locked.chmod(0o755)
    err = capsys.readouterr().err
    assert err.startswith(f'nanochat-dl {cmd}: error: {locked/"data"}') and 'Permission denied' in err and len(err.splitlines()) == 1, err


def test_a_206_must_continue_the_version_and_size_of_the_first_answer():
    "Offset, total size and validator of a 206 are checked against the first answer; any mismatch starts the file over."
    import io, re
    from types import SimpleNamespace
    from requests.structures import CaseInsensitiveDict
    from nanochat_dl.io.http import _Body, _Retry
    def resp(status, **headers): return SimpleNamespace(status_code=status, headers=CaseInsensitiveDict(headers), history=[])
    first = {'Content-Length': '100', 'Accept-Ranges': 'bytes', 'ETag': '"v1"', 'Last-Modified': 'Mon, 01 Jan 2024 00:00:00 GMT'}
    def holding_40(**over):
        b = _Body(io.BytesIO()); assert b.take(resp(200, **{**first, **over})); b.write(b'x' * 40); return b
    b = holding_40()
    assert b.resume_headers() == {'Range': 'bytes=40-', 'If-Range': '"v1"'}
    assert b.take(resp(206, **{'Content-Range': 'bytes 40-99/100', 'ETag': '"v1"'})) and b.written == 40
    for headers, why in [({'Content-Range': 'bytes 40-119/120'}, 'the file changed on the server: 120 bytes, the first answer said 100'),
                         ({'Content-Range': 'bytes 40-99/100', 'ETag': '"v2"'}, 'the file changed on the server: "v2", the first answer said "v1"'),
                         ({'Content-Range': 'bytes 0-99/100'}, "asked for bytes from 40, got Content-Range 'bytes 0-99/100'")]:
        b = holding_40()
        with pytest.raises(_Retry, match=re.escape(why)): b.take(resp(206, **headers))
        assert b.written == 0 and b.f.getvalue() == b''
    assert holding_40(ETag='W/"weak"').resume_headers()['If-Range'] == first['Last-Modified']   # a weak ETag cannot be used
    b = holding_40(**{'Accept-Ranges': 'none'})
    assert b.resume_headers() == {} and b.written == 0                   # no ranges: ask for the whole file again
    assert not holding_40().take(resp(404))                              # anything else: the caller's error
