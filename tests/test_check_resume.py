"""`nanochat-dl check-resume` as a user runs it (issue 22, section 4): the console command in a subprocess, over a
small copy of the offline sample (text shards, a tokenizer, the same text tokenized into a token root), for both
loaders, with a rescale, and refusing bad input with exit code 2 and a message naming what is wrong."""
import json, os, shutil, subprocess, sys
from pathlib import Path

import pytest

from toytext import small_corpus

CLI = shutil.which('nanochat-dl') or str(Path(sys.executable).parent / 'nanochat-dl')


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp('check_resume')
    small_corpus(d)
    return d


def cli(*args, home=None):
    env = {**os.environ, 'NANOCHAT_DL_BASE_DIR': str(home)} if home else None
    return subprocess.run([CLI, 'check-resume', *map(str, args)],
                          capture_output=True, text=True, timeout=600, env=env)


def test_tokens_stop_and_go_and_rescale_pass(data):
    r = cli('--loader', 'tokens', '--data', data/'root', '-b', 4, '-t', 64, '--batches', 8,
            '--world-size-from', 2, '--world-size-to', 3, '--rescale-stop', 3)
    assert r.returncode == 0, r.stderr + r.stdout
    lines = r.stdout.splitlines()
    table = lines[lines.index(next(l for l in lines if l.startswith('check '))):]
    assert [l.split()[:2] for l in table[1:]] == [['stop', 'and'], ['stop', 'and'], ['stop', 'and'], ['rescale', '2']]
    assert all(' PASS ' in l for l in table[1:]), table
    assert '200 documents of epoch 1: 200 started before and after the save, 0 held' in table[-1], table[-1]


def test_text_with_a_config_file_passes(data, tmp_path):
    cfg = tmp_path/'settings.toml'
    cfg.write_text('pack_buffer = 16\ntokenizer_threads = 1\n')
    r = cli('--loader', 'text', '--data', data/'text', '--tokenizer-dir', data/'tok', '-b', 4, '-t', 64,
            '--batches', 6, '--stop', 2, '--config', cfg, '--world-size-from', 1, '--world-size-to', 2)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "settings {'pack_buffer': 16, 'tokenizer_threads': 1}" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith('rescale 1 -> 2 ranks') and 'FAIL' not in r.stdout


@pytest.mark.parametrize('args, message', [
    (['--world-size-from', 2], 'a rescale needs both world sizes'),
    (['--batches', 4, '--stop', 4], 'stop=4 must be below batches=4'),
    (['--config', 'nowhere.json'], 'nowhere.json'),
    (['--loader', 'arrow'], "--loader 'arrow' is not one of ('text', 'tokens')"),
    (['--world-size-from', 0, '--world-size-to', 2], 'world_size_from=0 is invalid'),
])
def test_bad_input_is_refused_by_name(data, args, message):
    r = cli('--loader', 'tokens', '--data', data/'root', '-b', 4, '-t', 64, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert 'Traceback' not in r.stderr


def test_a_setting_the_loader_does_not_take_is_named(data, tmp_path):
    (tmp_path/'typo.json').write_text(json.dumps({'shuffel_window': 3}))
    r = cli('--loader', 'tokens', '--data', data/'root', '-b', 4, '-t', 64, '--config', tmp_path/'typo.json')
    assert r.returncode == 2 and 'shuffel_window' in r.stderr, r.stderr
