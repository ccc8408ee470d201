"""Toy text data for the loader tests: row groups of repeated words, a tokenizer trained in the test, each document's length."""
from nanochat_dl.text.sample import make_sample_shards
from nanochat_dl.text.shards import read_documents
from nanochat_dl.testing import write_toy_shards
from nanochat_dl.text.tokenizer import train_tokenizer


def words(f, g, r): return ' '.join([f"w{f}{g}{r}x"] * (1 + (7 * f + 3 * g + 5 * r) % 23))


def toy_text_env(d, layout):
    "Shards of `layout` (rows per row group, per file) under `d/toy`, a tokenizer in `d/tok`, and each document's tokens."
    make_sample_shards(d / 'base_data')
    tok = train_tokenizer(d / 'base_data', vocab_size=1024, out_dir=d / 'tok', progress=False)
    files = write_toy_shards(d / 'toy', layout, text_fn=words)
    addrs = [(f, g, r) for f, rows in enumerate(layout) for g, n in enumerate(rows) for r in range(n)]
    lens = dict(zip(addrs, map(len, tok.encode(read_documents(files, addrs), prepend=tok.get_bos_token_id()))))
    return dict(dir=d, tok=tok, tok_dir=d / 'tok', files=files, lens=lens)


def raw_text_shard(path, groups):
    "A shard whose 'text' column holds the given bytes, valid UTF-8 or not (pyarrow does not check them on write); `groups`: one list of bytes per row group."
    import numpy as np, pyarrow as pa, pyarrow.parquet as pq
    with pq.ParquetWriter(path, pa.schema([('text', pa.string())])) as w:
        for rows in groups:
            offsets = np.cumsum([0] + [len(b) for b in rows]).astype(np.int32)
            arr = pa.Array.from_buffers(pa.string(), len(rows), [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b''.join(rows))])
            w.write_table(pa.table({'text': arr}))
    return path


def small_corpus(d, docs=slice(0, 300), vocab=512, text='text', tok='tok', root='root'):
    "The offline sample's documents `docs` as 3 shards, a tokenizer of `vocab` ids, a token root ('web') of them."
    import contextlib, io
    from nanochat_dl.text.sample import make_sample_shards, sample_documents
    from nanochat_dl.text.tokenizer import train_tokenizer
    from nanochat_dl.tokens.tokenizing import tokenize
    make_sample_shards(d / text, n_shards=3, row_group_size=16, docs=sample_documents()[docs])
    t = train_tokenizer(d / text, vocab_size=vocab, out_dir=d / tok, progress=False)
    if root:
        with contextlib.redirect_stdout(io.StringIO()):
            tokenize(d / text, d / root, 'web', tokenizer_dir=d / tok, workers=1, progress=False, verbose=False)
    return t
