"""Tests for nanochat_dl.text.tokenizer: training, encoding invariants, pickle-free save/load, shards, CLI, offline errors."""
import base64, importlib, json, os, re, subprocess, sys, unicodedata
from pathlib import Path

import pyarrow as pa, pyarrow.parquet as pq
import pydoc_data.topics
import pytest
import requests
import tiktoken, tiktoken.registry
from hypothesis import given, settings, strategies as st

from nanochat_dl.core import atomic_write
from nanochat_dl.text.tokenizer import (BOS_TOKEN, META_FILE, RANKS_FILE, SPECIAL_TOKENS, Tokenizer, dump_tiktoken_bpe,
                                   get_tokenizer, iter_texts, parse_tiktoken_bpe, train_tokenizer, train_tokenizer_cli)
from toytext import raw_text_shard

TOPICS = list(pydoc_data.topics.topics.values())
MODS = ['argparse', 'asyncio', 'collections', 'csv', 'dataclasses', 'datetime', 'decimal', 'email', 'functools',
        'heapq', 'itertools', 'json', 'logging', 'pathlib', 'pickle', 'random', 're', 'shutil', 'statistics',
        'subprocess', 'tarfile', 'threading', 'typing', 'unittest', 'uuid', 'zipfile']
HELDOUT = [d for m in MODS if (d := importlib.import_module(m).__doc__)]


def _script(lo, hi):
    return ''.join(c for c in map(chr, range(lo, hi)) if unicodedata.category(c)[0] in 'LNPSZ')


UNICODE = ["Grüße aus Köln: naïve café, 10 € für ½ Stück.", "Привет, мир!", "你好，世界。", "こんにちは 🌍🚀 👩‍👩‍👧 e\u0301",
           "مرحبا بالعالم", "नमस्ते दुनिया", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∀x∈ℝ", "\t\r\n\x00\x7f\u200b\ufeff", "", " ", "\n\n\n",
           _script(0x0100, 0x0800), _script(0x3040, 0x3100), _script(0xAC00, 0xAD00), _script(0x1F300, 0x1F700)]
# many docs: the reference split into paragraphs, plus held-out docstrings and unicode
CORPUS = [p for t in TOPICS for p in t.split('\n\n')] + HELDOUT + UNICODE
LITERAL_SPECIALS = ["<|bos|>", "a<|bos|>b", "".join(SPECIAL_TOKENS), "<|endoftext|> <|user_start|>hi<|user_end|>",
                    "<|bos|" + ">", "text <|bos|>\n<|bos|><|bos|>"]


@pytest.fixture(scope='module')
def tok():
    return Tokenizer.train_from_iterator(TOPICS, 1024)


def _special_ids(t):
    return {t.encode_special(s) for s in t.get_special_tokens()}


# ---------------------------------------------------------------- training

@pytest.mark.parametrize('vocab_size', [265, 300, 512, 1024, 4096])
def test_vocab_size_is_exact(vocab_size):
    t = Tokenizer.train_from_iterator(TOPICS, vocab_size)
    assert t.get_vocab_size() == vocab_size == t.enc.n_vocab
    assert len(t.enc._mergeable_ranks) == vocab_size - len(SPECIAL_TOKENS)
    assert [t.encode_special(s) for s in SPECIAL_TOKENS] == list(range(vocab_size - 9, vocab_size))
    assert t.get_bos_token_id() == vocab_size - 9 and t.bos_token == BOS_TOKEN
    assert sorted(t.enc._mergeable_ranks.values()) == list(range(vocab_size - 9))


def test_training_is_deterministic():
    a, b = Tokenizer.train_from_iterator(TOPICS, 700), Tokenizer.train_from_iterator(iter(TOPICS), 700)
    assert a.enc._mergeable_ranks == b.enc._mergeable_ranks


def test_training_refuses_impossible_sizes():
    with pytest.raises(ValueError, match=r"vocab_size=264 is too small: it must be an int >= 265"):
        Tokenizer.train_from_iterator(TOPICS, 264)
    with pytest.raises(ValueError, match="vocab_size=300.0 is invalid: it must be an int >= 265"):
        Tokenizer.train_from_iterator(TOPICS, 300.0)
    with pytest.raises(ValueError, match=r"too small for vocab_size=300: only 2 merges could be learned, 35 were needed"):
        Tokenizer.train_from_iterator(["ab ab ab"], 300)
    with pytest.raises(ValueError, match="only 0 merges"):
        Tokenizer.train_from_iterator([], 300)
    with pytest.raises(TypeError, match="not a single string"):
        Tokenizer.train_from_iterator("a whole corpus as one str", 300)


def test_training_uses_nanochat_split_pattern(tok):
    # numbers are split in groups of at most two digits, so no token can span three digits
    assert not any(re.search(rb'\d{3}', b) for b in tok.enc._mergeable_ranks)
    t = Tokenizer.train_from_iterator(TOPICS + ["12345 67 8 " * 500], 600)
    digit_tokens = [b for b in t.enc._mergeable_ranks if re.search(rb'\d', b)]
    assert b'12' in digit_tokens and b'34' in digit_tokens and b'67' in digit_tokens
    assert all(len(b) <= 2 and b.isdigit() for b in digit_tokens)


# ---------------------------------------------------------------- encoding invariants

def test_round_trip_is_lossless(tok):
    assert len(CORPUS) > 1000
    rows = tok.encode(CORPUS)
    assert [tok.decode(r) for r in rows] == CORPUS
    assert all(tok.encode(d) == r for d, r in zip(CORPUS[::50], rows[::50]))
    assert sum(map(len, rows)) < sum(len(d.encode()) for d in CORPUS)  # it does compress


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_property(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert not set(ids) & _special_ids(tok)


def test_bos_prepended_once_per_doc(tok):
    docs = CORPUS[:300] + LITERAL_SPECIALS
    bos = tok.get_bos_token_id()
    for prepend in (bos, BOS_TOKEN):
        rows = tok.encode(docs, prepend=prepend)
        assert [r[0] for r in rows] == [bos] * len(docs)
        assert [r.count(bos) for r in rows] == [1] * len(docs)
        assert [r[1:] for r in rows] == tok.encode(docs)
    assert tok.encode("hello", prepend=bos) == [bos] + tok.encode("hello")
    assert tok.encode("", prepend=bos) == [bos]


def test_append_and_both(tok):
    end = tok.encode_special("<|assistant_end|>")
    docs = ["a", "", "<|bos|>"]
    assert tok.encode(docs, append="<|assistant_end|>") == [tok.encode(d) + [end] for d in docs]
    assert tok.encode("x", prepend=BOS_TOKEN, append=end) == [tok.get_bos_token_id()] + tok.encode("x") + [end]
    assert tok("x", prepend=BOS_TOKEN) == tok.encode("x", prepend=BOS_TOKEN)


def test_plain_text_never_yields_special_ids(tok):
    specials = _special_ids(tok)
    for text in LITERAL_SPECIALS:
        ids = tok.encode(text)
        assert not set(ids) & specials, text
        assert tok.decode(ids) == text
    for rows in (tok.encode(LITERAL_SPECIALS, num_threads=1), tok.encode(LITERAL_SPECIALS, num_threads=4)):
        assert not any(set(r) & specials for r in rows)


def test_threads_give_identical_ids(tok):
    for n in (0, 1, 2, 4, 8):
        assert tok.encode(CORPUS, num_threads=n, prepend=BOS_TOKEN) == tok.encode(CORPUS, num_threads=1, prepend=BOS_TOKEN)
    # and the same as tiktoken's own pool
    assert tok.encode(CORPUS, num_threads=1) == tok.enc.encode_ordinary_batch(CORPUS, num_threads=4)
    assert tok.encode(tuple(CORPUS[:10]), num_threads=4) == tok.encode(CORPUS[:10])


def test_encode_errors(tok):
    with pytest.raises(ValueError, match="'hello' is not a special token"):
        tok.encode("x", prepend="hello")
    with pytest.raises(ValueError, match=r"append=1024 is outside the vocabulary \[0, 1024\)"):
        tok.encode("x", append=1024)
    with pytest.raises(TypeError, match="prepend must be a token id"):
        tok.encode("x", prepend=1.5)
    with pytest.raises(TypeError, match="expects a str or a list of str, got int"):
        tok.encode(5)


def test_small_api(tok):
    assert tok.get_special_tokens() == set(SPECIAL_TOKENS)
    assert tok.id_to_token(tok.get_bos_token_id()) == BOS_TOKEN
    tb = tok.token_bytes()
    assert len(tb) == 1024 and tb[:256] == [1] * 256 and tb[1015:] == [0] * 9
    assert all(tb[i] == len(tok.decode_single_token_bytes(i)) for i in range(1015))
    assert 'vocab_size=1024' in repr(tok)


# ---------------------------------------------------------------- save / load

def test_save_load_identical_and_pickle_free(tok, tmp_path):
    tok.save(tmp_path/'t')
    assert sorted(os.listdir(tmp_path/'t')) == sorted([META_FILE, RANKS_FILE])
    t2 = Tokenizer.load(tmp_path/'t')
    assert t2.encode(CORPUS, prepend=BOS_TOKEN) == tok.encode(CORPUS, prepend=BOS_TOKEN)
    assert t2.enc._mergeable_ranks == tok.enc._mergeable_ranks and t2.enc._pat_str == tok.enc._pat_str
    assert (t2.get_vocab_size(), t2.get_bos_token_id(), t2.get_special_tokens()) == (1024, 1015, set(SPECIAL_TOKENS))
    assert Tokenizer.from_directory(tmp_path/'t').encode("abc") == tok.encode("abc")
    # no pickle: plain ASCII text, JSON + one "base64 rank" per line
    meta_b, ranks_b = (tmp_path/'t'/META_FILE).read_bytes(), (tmp_path/'t'/RANKS_FILE).read_bytes()
    for b in (meta_b, ranks_b):
        assert not b.startswith(b'\x80') and b.isascii()
        assert b'pickle' not in b and b'__reduce__' not in b
    meta = json.loads(meta_b)
    assert meta['special_tokens'] == {s: 1015 + i for i, s in enumerate(SPECIAL_TOKENS)} and meta['bos_token'] == BOS_TOKEN
    lines = ranks_b.decode().splitlines()
    assert len(lines) == 1015 and all(re.fullmatch(r'[A-Za-z0-9+/]+=* \d+', l) for l in lines)
    assert [int(l.split()[1]) for l in lines] == list(range(1015))


def test_tiktoken_reads_our_ranks_file(tok, tmp_path, monkeypatch):
    from tiktoken.load import load_tiktoken_bpe
    tok.save(tmp_path)
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', '')
    assert load_tiktoken_bpe(str(tmp_path/RANKS_FILE)) == tok.enc._mergeable_ranks
    assert parse_tiktoken_bpe(dump_tiktoken_bpe(tok.enc._mergeable_ranks)) == tok.enc._mergeable_ranks


def test_save_overwrites_and_detects_a_torn_save(tok, tmp_path):
    other = Tokenizer.train_from_iterator(HELDOUT, 600)
    tok.save(tmp_path)
    other.save(tmp_path)  # overwriting a saved tokenizer replaces it
    assert Tokenizer.load(tmp_path).encode(CORPUS[:50]) == other.encode(CORPUS[:50])
    assert not [f for f in os.listdir(tmp_path) if f.endswith('.tmp')]
    # a save interrupted after the ranks file but before the JSON: detected, not silently mixed
    atomic_write(tmp_path/RANKS_FILE, dump_tiktoken_bpe(tok.enc._mergeable_ranks))
    with pytest.raises(ValueError, match="does not match the ranks_sha256"):
        Tokenizer.load(tmp_path)


def test_train_info_round_trips(tok, tmp_path):
    t = Tokenizer.train_from_iterator(TOPICS, 300)
    t.train_info = {'chars': 12, 'train_files': ['a.parquet']}
    t.save(tmp_path)
    assert Tokenizer.load(tmp_path).train_info == {'chars': 12, 'train_files': ['a.parquet']}


def _edit(src, dst, ranks=None, meta=None, fix_hash=False):
    import hashlib, shutil
    shutil.copytree(src, dst)
    if ranks: (dst/RANKS_FILE).write_bytes(ranks((dst/RANKS_FILE).read_bytes()))
    if meta: (dst/META_FILE).write_text(meta((dst/META_FILE).read_text()))
    if fix_hash:
        m = json.loads((dst/META_FILE).read_text())
        m['ranks_sha256'] = hashlib.sha256((dst/RANKS_FILE).read_bytes()).hexdigest()
        (dst/META_FILE).write_text(json.dumps(m))
    return dst


def _meta(**kw):
    def f(text):
        m = json.loads(text); m.update(kw)
        return json.dumps({k: v for k, v in m.items() if v is not None})
    return f


def _first_line(new):
    return lambda b: new + b[b.index(b'\n'):]


MALFORMED = {
    'bad base64': (dict(ranks=_first_line(b'@@@ 0'), fix_hash=True), RANKS_FILE + r", line 1: b'@@@' is not valid base64"),
    'bad padding': (dict(ranks=_first_line(b'AAA 0'), fix_hash=True), r"line 1: b'AAA' is not valid base64"),
    'non-int rank': (dict(ranks=_first_line(b'AA== zero')), r"line 1: rank b'zero' is not a non-negative integer"),
    'negative rank': (dict(ranks=_first_line(b'AA== -1')), r"line 1: rank b'-1' is not a non-negative integer"),
    'three fields': (dict(ranks=_first_line(b'AA== 0 7')), r"line 1: expected '<base64 token> <rank>'"),
    'duplicate token': (dict(ranks=lambda b: b + b'AA== 1015\n'), r"token b'\\x00' appears twice"),
    'gap in ranks': (dict(ranks=lambda b: b + b'//79 2000\n'), r"ranks must be 0..1015, each exactly once"),
    'missing byte': (dict(ranks=lambda b: _first_line(b'//79 0')(b)), r"single-byte tokens missing for bytes \[0\]"),
    'empty ranks': (dict(ranks=lambda b: b''), RANKS_FILE + ": no tokens"),
    'hash mismatch': (dict(ranks=lambda b: b + b'//79 1015\n'), "does not match the ranks_sha256"),
    'bad json': (dict(meta=lambda t: t[:len(t) // 2]), META_FILE + ": not valid JSON"),
    'json list': (dict(meta=lambda t: '[1, 2]'), META_FILE + ": expected a JSON object, got list"),
    'duplicate json key': (dict(meta=lambda t: t.replace('{', '{"name": "x", ', 1)), "duplicate key 'name'"),
    'missing pattern': (dict(meta=_meta(pattern=None)), META_FILE + ": missing key 'pattern'"),
    'missing specials': (dict(meta=_meta(special_tokens=None)), "missing key 'special_tokens'"),
    'missing hash': (dict(meta=_meta(ranks_sha256=None)), "missing key 'ranks_sha256'"),
    'wrong format': (dict(meta=_meta(format='tiktoken/9')), "format is 'tiktoken/9', expected 'nanochat_dl.tokenizer/1'"),
    'pattern not str': (dict(meta=_meta(pattern=5)), "'pattern' must be a str, got int"),
    'special id str': (dict(meta=_meta(special_tokens={'<|bos|>': '1015'})), r"special token '<\|bos\|>' needs .* got '1015'"),
    'special id bool': (dict(meta=_meta(special_tokens={'<|bos|>': True})), r"needs a non-empty name and an int id"),
    'special id shared': (dict(meta=_meta(special_tokens={'<|bos|>': 1015, '<|x|>': 1015})), "two special tokens share an id"),
    'special id collides': (dict(meta=_meta(special_tokens={'<|bos|>': 3})), r"collide with mergeable token ids 0..1014"),
    'bos not special': (dict(meta=_meta(bos_token='<|eos|>')), r"bos_token '<\|eos\|>' is not among special_tokens"),
    'bad regex': (dict(meta=_meta(pattern='[unclosed')), META_FILE + r": bad split pattern"),
}


@pytest.fixture(scope='module')
def saved(tok, tmp_path_factory):
    return tok.save(tmp_path_factory.mktemp('saved')/'tok')


@pytest.mark.parametrize('case', list(MALFORMED))
def test_malformed_files_give_clear_errors(saved, tmp_path, case):
    edit, msg = MALFORMED[case]
    d = _edit(saved, tmp_path/'t', **edit)
    with pytest.raises(ValueError, match=msg) as e:
        Tokenizer.load(d)
    assert str(d) in str(e.value)  # the message names the file


def test_missing_files(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer directory at"):
        Tokenizer.load(tmp_path/'absent')
    d = _edit(saved, tmp_path/'a'); (d/RANKS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(d/RANKS_FILE)) + " is missing"):
        Tokenizer.load(d)
    d = _edit(saved, tmp_path/'b'); (d/META_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(str(d/META_FILE)) + " is missing"):
        Tokenizer.load(d)


def test_get_tokenizer(tok, tmp_path, monkeypatch):
    monkeypatch.setenv('NANOCHAT_DL_BASE_DIR', str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no trained tokenizer in .*nanochat-dl train-tokenizer --vocab-size 8192"):
        get_tokenizer()
    tok.save(tmp_path/'tokenizer')
    assert get_tokenizer().encode(CORPUS[:20]) == tok.encode(CORPUS[:20])
    assert get_tokenizer(tmp_path/'tokenizer').get_vocab_size() == 1024


# ---------------------------------------------------------------- shards, train_tokenizer, CLI

def _write_shards(d, n=3, rows_per_group=16):
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        docs = TOPICS[i::n] if i < n - 1 else ["VALIDATION " * 30] + HELDOUT
        pq.write_table(pa.table({'text': docs}), d/f'shard_{i:05d}.parquet', row_group_size=rows_per_group)
    return d


def test_iter_texts_caps_and_order(tmp_path):
    p = tmp_path/'s.parquet'
    pq.write_table(pa.table({'text': ["0123456789", None, "abc", "defghij", "klm"]}), p, row_group_size=2)
    assert list(iter_texts([p])) == ["0123456789", "abc", "defghij", "klm"]
    assert list(iter_texts([p], doc_cap=4)) == ["0123", "abc", "defg", "klm"]
    stats = {}
    assert list(iter_texts([p], max_chars=15, stats=stats)) == ["0123456789", "abc", "de"]
    assert stats == {'chars': 15, 'docs': 3, 'row_groups': 2}
    assert list(iter_texts([p], max_chars=13)) == ["0123456789", "abc"]
    assert list(iter_texts([p], max_chars=0)) == []
    assert list(iter_texts([p, p], doc_cap=1)) == list("0adk") * 2
    assert list(iter_texts([p], max_chars=15, progress=True)) == ["0123456789", "abc", "de"]


def test_train_tokenizer_uses_train_shards_only(tmp_path):
    data = _write_shards(tmp_path/'data')
    tok = train_tokenizer(data, vocab_size=600, max_chars=100_000, doc_cap=5000, out_dir=tmp_path/'out', progress=False)
    train_files = [data/'shard_00000.parquet', data/'shard_00001.parquet']
    expected = list(iter_texts(train_files, max_chars=100_000, doc_cap=5000))
    assert sum(map(len, expected)) == 100_000 == tok.train_info['chars']
    assert tok.train_info['train_files'] == ['shard_00000.parquet', 'shard_00001.parquet']
    assert tok.enc._mergeable_ranks == Tokenizer.train_from_iterator(expected, 600).enc._mergeable_ranks
    assert not any(b'VALIDATION' in b for b in tok.enc._mergeable_ranks)
    loaded = Tokenizer.load(tmp_path/'out')
    assert loaded.encode(CORPUS) == tok.encode(CORPUS) and loaded.train_info == tok.train_info


def test_train_tokenizer_needs_two_shards(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no parquet shards in .*nanochat-dl sample.*nanochat-dl download"):
        train_tokenizer(tmp_path/'none', vocab_size=300, out_dir=tmp_path/'o', progress=False)
    _write_shards(tmp_path/'one', n=1)
    with pytest.raises(FileNotFoundError, match=r"only one shard \(shard_00000.parquet\).*at least 2"):
        train_tokenizer(tmp_path/'one', vocab_size=300, out_dir=tmp_path/'o', progress=False)
    assert not (tmp_path/'o').exists()


def test_cli_through_router(tmp_path, capsys):
    from nanochat_dl.cli import main
    data = _write_shards(tmp_path/'data')
    rc = main(['train-tokenizer', '--vocab-size', '700', '--max-chars', '100000', '--data-dir', str(data),
               '--out-dir', str(tmp_path/'out')])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "trained on 100,000 chars" in out and "vocab size 700 (9 special, bos <|bos|>=691)" in out
    assert re.search(rf"val compression: \d+\.\d\d bytes/token on {1 + len(HELDOUT)} docs of the val shard", out), out
    assert f"saved to {tmp_path/'out'}" in out
    assert Tokenizer.load(tmp_path/'out').get_vocab_size() == 700
    # bad vocab size: error message, exit code 2 (bad argument), nothing saved
    assert train_tokenizer_cli(vocab_size=100, data_dir=str(data), out_dir=str(tmp_path/'out2')) == 2
    assert "vocab_size=100 is too small" in capsys.readouterr().err
    assert not (tmp_path/'out2').exists()


def test_cli_no_shards_subprocess(tmp_path):
    env = dict(os.environ, NANOCHAT_DL_BASE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, '-c', 'import sys; from nanochat_dl.cli import main; sys.exit(main())',
                        'train-tokenizer', '--vocab-size', '300'], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "no parquet shards in" in r.stderr and "nanochat-dl sample" in r.stderr and "nanochat-dl download" in r.stderr


# ---------------------------------------------------------------- pretrained encodings

@pytest.fixture
def no_cache(tmp_path, monkeypatch):
    "An empty tiktoken cache and no in-memory encodings, so get_encoding must fetch."
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', str(tmp_path/'cache'))
    monkeypatch.setattr(tiktoken.registry, 'ENCODINGS', {})
    return tmp_path/'cache'


def test_from_pretrained_offline_message_mocked(no_cache, monkeypatch):
    def offline(url, *a, **k):
        raise requests.ConnectionError("Name or service not known", request=requests.Request('GET', url))
    monkeypatch.setattr(requests, 'get', offline)
    with pytest.raises(RuntimeError) as e:
        Tokenizer.from_pretrained('cl100k_base')
    msg = str(e.value)
    for part in ["'cl100k_base'", "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
                 "ConnectionError", "offline", str(no_cache), "TIKTOKEN_CACHE_DIR", "nanochat-dl train-tokenizer"]:
        assert part in msg, part
    assert isinstance(e.value.__cause__, requests.ConnectionError)


@pytest.mark.timeout(30)
def test_from_pretrained_real_network(no_cache, monkeypatch):
    "The real fetch, bounded: offline it must give our message; online it must give GPT-2 with <|endoftext|> as BOS."
    real_get = requests.get
    monkeypatch.setattr(requests, 'get', lambda url, *a, **k: real_get(url, *a, **{**k, 'timeout': 5}))
    try:
        t = Tokenizer.from_pretrained('gpt2')
    except RuntimeError as e:
        assert "could not fetch the vocabulary file of tiktoken encoding 'gpt2'" in str(e)
        assert "TIKTOKEN_CACHE_DIR" in str(e)
    else:
        assert t.get_bos_token_id() == 50256 and t.get_vocab_size() == 50257


def test_from_pretrained_cached_and_unknown(tok, tmp_path, monkeypatch):
    "An encoding whose file tiktoken can read locally (as from its cache) works, with <|endoftext|> as BOS."
    from tiktoken.load import load_tiktoken_bpe
    tok.save(tmp_path/'t')
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', '')
    tiktoken.list_encoding_names()
    monkeypatch.setitem(tiktoken.registry.ENCODING_CONSTRUCTORS, 'toy_cached', lambda: dict(
        name='toy_cached', pat_str=tok.enc._pat_str, special_tokens={'<|endoftext|>': 1015},
        mergeable_ranks=load_tiktoken_bpe(str(tmp_path/'t'/RANKS_FILE))))
    monkeypatch.setattr(tiktoken.registry, 'ENCODINGS', {})
    t = Tokenizer.from_pretrained('toy_cached')
    assert t.bos_token == '<|endoftext|>' and t.get_bos_token_id() == 1015
    assert t.encode(CORPUS[:100], prepend='<|endoftext|>') == tok.encode(CORPUS[:100], prepend=BOS_TOKEN)
    with pytest.raises(ValueError, match="unknown tiktoken encoding 'nope'"):
        Tokenizer.from_pretrained('nope')




def test_invalid_utf8_in_training_text(tmp_path, capsys):
    """A shard with bytes that are not UTF-8 used to stop training with a bare UnicodeDecodeError: the error names the
    file, row group and row, and `--utf8-errors replace` trains on the text with U+FFFD in their place."""
    from nanochat_dl.cli import main
    data = _write_shards(tmp_path / 'data')
    bad = raw_text_shard(data / 'shard_00001.parquet', [[t.encode() for t in TOPICS[:3]], [b'ok', b'caf\xe9 au lait', b'x']])
    with pytest.raises(ValueError, match=re.escape(f"{bad}: row group 1, row 1: 'text' is not valid UTF-8 (invalid continuation byte at byte 3")):
        list(iter_texts([bad]))
    assert list(iter_texts([bad], utf8_errors='replace'))[3:] == ['ok', 'caf\ufffd au lait', 'x']
    args = ['train-tokenizer', '--vocab-size', '600', '--max-chars', '100000', '--data-dir', str(data), '--out-dir', str(tmp_path / 'out')]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{bad}: row group 1, row 1: 'text' is not valid UTF-8" in err and "--utf8-errors replace" in err, err
    assert not (tmp_path / 'out').exists()
    assert main(args + ['--utf8-errors', 'replace']) == 0, capsys.readouterr().err
    assert Tokenizer.load(tmp_path / 'out').get_vocab_size() == 600
    with pytest.raises(ValueError, match=r"utf8_errors='skip' is invalid"): train_tokenizer(data, 600, utf8_errors='skip', progress=False)
