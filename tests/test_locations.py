"""A user's locations, as the README promises them (issue 19, section 6): `~` expanded and `file://` URIs taken as
local paths alike by every loader, `tokenize` and the environment variables; never a `file:` folder under the CWD."""
import os
from pathlib import Path

import pytest

from nanochat_dl.tokens import tokenize
from nanochat_dl.cli import main
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.tokens import StreamingLoader
from toytext import toy_text_env

LAYOUT = [[3, 2], [2, 3], [4]]


@pytest.fixture(scope='module')
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp('loc')
    e = toy_text_env(d, LAYOUT)
    tokenize(d/'toy', d/'tokens', 'web', e['tok_dir'], workers=1, progress=False, verbose=False)
    return e


def first_rows(make):
    with make() as ld: return next(ld)[0].tolist()


def test_the_stream_root_as_a_home_path_and_a_file_uri(env, monkeypatch):
    d = env['dir']
    want = first_rows(lambda: StreamingLoader(d/'tokens', 8, 2, prefetch=0))
    monkeypatch.setenv('HOME', str(d))
    assert first_rows(lambda: StreamingLoader('~/tokens', 8, 2, prefetch=0)) == want            # the README's own example
    assert first_rows(lambda: StreamingLoader(f'file://{d}/tokens', 8, 2, prefetch=0)) == want


def test_the_text_loader_from_a_file_uri_and_the_environment(env, monkeypatch):
    d, tok = env['dir'], env['tok']
    kw = dict(tokenizer_threads=1, device='cpu', buffer_size=8)
    want = first_rows(lambda: PackedLoader(tok, 2, 16, 'train', d/'toy', **kw))
    assert first_rows(lambda: PackedLoader(tok, 2, 16, 'train', f'file://{d}/toy', **kw)) == want
    monkeypatch.setenv('NANOCHAT_DL_DATA_DIR', f'file://{d}/toy')
    assert first_rows(lambda: PackedLoader(tok, 2, 16, 'train', **kw)) == want
    monkeypatch.setenv('HOME', str(d)); monkeypatch.setenv('NANOCHAT_DL_DATA_DIR', '~/toy')
    assert first_rows(lambda: PackedLoader(tok, 2, 16, 'train', **kw)) == want


def test_tokenize_into_and_from_file_uris(env, tmp_path, monkeypatch):
    d = env['dir']
    monkeypatch.chdir(tmp_path)
    rc = main(['tokenize', '--data-dir', f'file://{d}/toy', '--out', f'file://{tmp_path}/out', '--dataset', 'web',
               '--tokenizer-dir', str(env['tok_dir']), '-w', '1', '--no-progress'])
    assert rc == 0
    assert not (tmp_path/'file:').exists()                                       # not under the CWD
    got = sorted(p.relative_to(tmp_path/'out') for p in (tmp_path/'out').rglob('*.arrow'))
    want = sorted(p.relative_to(d/'tokens') for p in (d/'tokens').rglob('*.arrow'))
    assert got == want and got
    for p in want: assert (tmp_path/'out'/p).read_bytes() == (d/'tokens'/p).read_bytes()


def test_a_file_uri_naming_a_host_is_refused(env):
    with pytest.raises(ValueError, match="names host 'elsewhere'"): StreamingLoader('file://elsewhere/tokens', 8, 2)
