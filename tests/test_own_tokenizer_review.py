"""Adversarial review of "your own tokenizer" (issue 22, part 3): inputs a hostile user gives `as_tokenizer`,
`load_tokenizer`, the loaders and the commands, each defect's test written before its fix."""
import json, subprocess, sys

import pytest
import tiktoken

from nanochat_dl.cli import main
from nanochat_dl.text.adapt import as_tokenizer, load_tokenizer
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.text.sample import make_sample_shards, sample_documents
from nanochat_dl.text.tokenizer import Tokenizer

tokenizers = pytest.importorskip('tokenizers')


@pytest.fixture(scope='module')
def env(tmp_path_factory):
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers
    d = tmp_path_factory.mktemp('owntokrev')
    docs = sample_documents()[:120]
    make_sample_shards(d / 'text', n_shards=2, row_group_size=16, docs=docs)
    t = HF(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train_from_iterator(docs[:60], trainers.BpeTrainer(vocab_size=500, special_tokens=['<s>', '</s>'],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    wl = HF(models.WordLevel(unk_token=None))   # no unk token: an unknown word cannot be encoded
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    wl.train_from_iterator(docs[:10], trainers.WordLevelTrainer(vocab_size=200, special_tokens=['<s>'],
                                                                show_progress=False))
    wl.save(str(d / 'wl.json'))
    t.save(str(d / 'tokenizer.json'))
    return dict(dir=d, docs=docs, hf=t, wl=wl, ours=Tokenizer.train_from_iterator(docs[:60], 400))


def test_bpe_dropout_is_refused(env):
    "BPE dropout samples other merges at each encode: ids would differ run to run, no exact resume."
    j = json.loads(env['hf'].to_str())
    j['model']['dropout'] = 0.3
    with pytest.raises(ValueError, match=r"dropout=0.3.*the same ids every time"):
        as_tokenizer(tokenizers.Tokenizer.from_str(json.dumps(j)))
    j['model']['dropout'] = 0.0   # none in effect: fine
    as_tokenizer(tokenizers.Tokenizer.from_str(json.dumps(j)))


def test_tiktoken_special_tokens_are_read_by_id_not_by_bytes(env):
    "A special token whose text is also an ordinary token's bytes: its id is the special one."
    e = env['ours'].enc
    enc = tiktoken.Encoding('odd', pat_str=e._pat_str, mergeable_ranks=e._mergeable_ranks,
                            special_tokens={'e': 500, '<|endoftext|>': 501})
    t = as_tokenizer(enc, bos='e')
    assert t.bos_token_id == 500 and t.eos_token_id == 501 and t.encode_special('e') == 500
    assert t.encode('e') == enc.encode_ordinary('e') == [101]   # in text: the ordinary token


def test_tiktoken_special_ids_colliding_with_ordinary_ids_are_refused(env):
    "A special id that is also an ordinary token's id: BOS would be indistinguishable from text (as `Tokenizer.load`)."
    e = env['ours'].enc
    enc = tiktoken.Encoding('clash', pat_str=e._pat_str, mergeable_ranks=e._mergeable_ranks,
                            special_tokens={'<|bos|>': 5})
    with pytest.raises(ValueError, match=r"special token ids \{'<\|bos\|>': 5\} collide with ordinary token ids"):
        as_tokenizer(enc)


def test_a_tokenizer_path_that_is_a_uri_is_refused_naming_it(env, tmp_path, capsys):
    for uri in ('s3://bucket/tok/tokenizer.json', 'gs://b/tok'):
        with pytest.raises(ValueError, match=f"tokenizer {uri!r} is a URI"):
            load_tokenizer(uri)
        with pytest.raises(ValueError, match=f"tokenizer {uri!r} is a URI"):
            PackedLoader(uri, 2, 32, data_dir=env['dir'] / 'text', device='cpu')
    assert main(['tokenize', '--data-dir', str(env['dir'] / 'text'), '--out', str(tmp_path / 'r'), '--dataset', 'web',
                 '--tokenizer', 's3://bucket/tokenizer.json', '--no-progress']) == 2
    assert "tokenizer 's3://bucket/tokenizer.json' is a URI" in capsys.readouterr().err
    assert load_tokenizer('file://' + str(env['dir'] / 'tokenizer.json')).fingerprint() == \
        as_tokenizer(env['hf']).fingerprint()   # a file:// URI is a local path


@pytest.mark.parametrize('how', ['threads', 'processes'])
def test_a_document_the_hf_tokenizer_cannot_encode_is_a_clear_error(env, how):
    "A WordLevel without an unk token meets an unknown word: a ValueError that says why, in threads and processes."
    kw = dict(data_dir=env['dir'] / 'text', device='cpu', tokenize_in=how, tokenizer_threads=2)
    with pytest.raises(ValueError, match=r"could not encode a document \(WordLevel error: Missing \[UNK\]"):
        with PackedLoader(str(env['dir'] / 'wl.json'), 2, 32, **kw) as ld: next(ld)


@pytest.mark.parametrize('argv', [
    ['tokenize', '--data-dir', '{d}/text', '--out', '{d}/r', '--dataset', 'web', '--tokenizer', '{d}/tokenizer.json',
     '--no-progress'],
    ['check-resume', '--data', '{d}/text', '--tokenizer-dir', '{d}/tokenizer.json', '--batches', '4', '--stop', '2'],
    ['demo', '--data-dir', '{d}/text', '--tokenizer-dir', '{d}/tokenizer.json', '--steps', '2']])
def test_commands_without_the_tokenizers_package_say_so_in_one_line(env, argv):
    "A tokenizer.json given, `tokenizers` missing: the command's one-line error and exit code 2, no traceback."
    argv = [a.format(d=env['dir']) for a in argv]
    code = ("import sys; sys.modules['tokenizers'] = None\n"
            f"from nanochat_dl.cli import main; sys.exit(main({argv!r}))\n")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    assert f"nanochat-dl {argv[0]}: error:" in r.stderr and 'pip install tokenizers' in r.stderr


def test_the_demo_does_not_train_into_a_missing_tokenizer_json(env, tmp_path, capsys):
    "A typo in a tokenizer.json's path: an error naming it, not a new tokenizer trained into a folder of that name."
    missing = tmp_path / 'tokenzier.json'
    assert main(['demo', '--data-dir', str(env['dir'] / 'text'), '--tokenizer-dir', str(missing), '--steps', '2']) == 2
    out, err = capsys.readouterr()
    assert 'training one' not in out and f"no tokenizer at {missing}" in err and not missing.exists()


def test_a_tokenizer_json_with_a_utf8_bom_is_read(env, tmp_path):
    "Windows editors start UTF-8 files with a BOM: the same tokenizer (its JSON after the BOM)."
    p = tmp_path / 'tokenizer.json'
    p.write_bytes(b'\xef\xbb\xbf' + (env['dir'] / 'tokenizer.json').read_bytes())
    assert load_tokenizer(p).fingerprint() == as_tokenizer(env['hf']).fingerprint()
    p.write_bytes(b'\xff\xfe{}')
    with pytest.raises(ValueError, match=r"tokenizer.json: not a Hugging Face tokenizer.json \(not UTF-8 text"):
        load_tokenizer(p)


def test_tokenize_reads_a_tokenizer_json_in_the_default_tokenizer_folder(env, tmp_path, monkeypatch):
    "No tokenizer named: the cache's tokenizer/ folder, which may hold a Hugging Face tokenizer.json."
    from nanochat_dl.tokens import read_manifest, tokenize
    monkeypatch.setenv('NANOCHAT_DL_BASE_DIR', str(tmp_path / 'base'))
    (tmp_path / 'base' / 'tokenizer').mkdir(parents=True)
    (tmp_path / 'base' / 'tokenizer' / 'tokenizer.json').write_bytes((env['dir'] / 'tokenizer.json').read_bytes())
    tokenize(env['dir'] / 'text', tmp_path / 'r', 'web', workers=1, progress=False, verbose=False)
    rec = read_manifest(tmp_path / 'r')['datasets']['web']['tokenizer']
    assert rec['fingerprint'] == as_tokenizer(env['hf']).fingerprint()


def test_lone_surrogates_still_become_the_replacement_character(env):
    "The error wrapping of the tokenizer's own errors keeps tiktoken's way with lone surrogates (U+FFFD)."
    t = as_tokenizer(env['hf'])
    assert t.encode('a\ud800b') == t.encode('a\ufffdb') and t.core.encode_ordinary_batch(['x', 'a\udfffb'])[1] == \
        t.encode('a\ufffdb')
