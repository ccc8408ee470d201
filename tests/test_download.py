"""Download path of nanochat_dl.dataset against a real HTTP server on 127.0.0.1 with injected faults:
retries, resume with Range, servers that ignore Range, HTML pages served as 200, short bodies, 404s,
skipping valid files, the parallel `download` summary and the CLI exit codes."""
import hashlib, os, shutil, socket, time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nanochat_dl.dataset import (BASE_URL_ENV, SOURCE_FILE, DownloadResult, ShardServer, download, download_cli, download_single_file,
                                 make_sample_shards, sample_cli, shard_summary)

FAST = dict(backoff=0.001, timeout=5)        # keep retries quick
NAMES = [f'shard_{i:05d}.parquet' for i in range(4)]


def sha(path): return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def listing(folder):
    "Everything in `folder` but its dataset marker."
    return sorted(f for f in os.listdir(folder) if f != SOURCE_FILE) if Path(folder).exists() else []


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
    server.fail(NAMES[3], 'html')
    r = download_single_file(3, tmp_path, base_url=server.url, **FAST)
    assert (r.ok, r.status) == (False, 'failed')
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
    server.fail(NAMES[2], 'html')
    r = download_single_file(2, tmp_path, base_url=server.url, **FAST)
    assert not r.ok and listing(tmp_path) == []


def test_connection_refused_names_file_and_url(tmp_path):
    with socket.socket() as s:                    # a port that nothing listens on
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
    server.fail(NAMES[1], 'html').fail(NAMES[2], 503)
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
@given(faults=st.lists(st.sampled_from([500, 503, 'drop', 'short', 'ignore_range', 'stall']), max_size=3),
       ranges=st.booleans())
def test_any_few_transient_faults_end_in_the_exact_file(served, tmp_path_factory, faults, ranges):
    "With at most max_retries transient faults the shard always arrives intact; nothing else is left behind."
    dest = tmp_path_factory.mktemp('dest')
    with ShardServer(served, ranges=ranges, stall_s=0.0) as srv:
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
