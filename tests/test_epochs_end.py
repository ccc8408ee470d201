"""Epochs end (issue 18, item 1) for the text loader's packers `bestfit-pad` and `bestfit-split`: every non-empty document
of epoch e is delivered (all its pieces) before any token of epoch e+2, on each rank's stream, across exact resumes and
rescales (the list of every rank's state at another world size). Tokens are attributed by the batches' segments."""
import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from nanochat_dl.dataset import make_sample_shards
from nanochat_dl.loader import PackedLoader
from nanochat_dl.shards import read_documents
from nanochat_dl.testing import write_toy_shards
from nanochat_dl.tokenizer import train_tokenizer

LAYOUT = [[3, 2, 4, 1, 3, 2], [2, 3, 1, 4, 2], [4, 1, 2, 3, 2, 1]]   # 38 documents in 6 columns
KW = dict(B=2, T=32, tokenizer_batch_size=2, device='cpu', tokenizer_threads=1, tokenize_in='threads', prefetch=0)
GUARDED = ('bestfit-pad', 'bestfit-split')


def words(f, g, r): return ' '.join([f"w{f}{g}{r}x"] * (1 + (7 * f + 3 * g + 5 * r) % 23))


@pytest.fixture(scope='module')
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp('epochs')
    make_sample_shards(d / 'base_data')
    tok = train_tokenizer(d / 'base_data', vocab_size=1024, out_dir=d / 'tok', progress=False)
    files = write_toy_shards(d / 'toy', LAYOUT, text_fn=words)
    addrs = [(f, g, r) for f, rows in enumerate(LAYOUT) for g, n in enumerate(rows) for r in range(n)]
    lens = dict(zip(addrs, map(len, tok.encode(read_documents(files, addrs), prepend=tok.get_bos_token_id()))))
    return dict(tok=tok, files=files, lens=lens)


def pieces(batch, split):
    "`(epoch, address, lo, hi)` for each segment of `batch`, in delivery order: the range of the document's tokens it stands for."
    for row in batch.segments:
        for s in row:
            k = tuple(s.key)
            yield k[0], k[1:], s.offset, s.offset + s.length + s.dropped - (split and s.offset > 0)


class Ledger:
    """What the streams delivered so far, checked at each segment: every document of epoch e that a stream must deliver is whole
    before that stream delivers a token of epoch e+2 (`owed(e)`: those documents; default: the ones it delivered a piece of)."""
    def __init__(self, lens): self.lens, self.cover = lens, defaultdict(list)
    def whole(self, e, a):
        rs = sorted(self.cover[e, a])
        return bool(rs) and rs[0][0] == 0 and rs[-1][1] == self.lens[a] and all(x[1] == y[0] for x, y in zip(rs, rs[1:]))
    def stream(self, owed=None): return dict(seen=defaultdict(set), started=set(), owed=owed)
    def add(self, s, batch, split, at):
        for e, a, lo, hi in pieces(batch, split):
            if e not in s['started'] and e - 2 >= 1:   # the first token of epoch e on this stream
                owed = s['seen'][e - 2] if s['owed'] is None else s['owed'](e - 2)
                late = [x for x in owed if not self.whole(e - 2, x)]
                assert not late, (f"{at}: the first token of epoch {e} came while {len(late)} documents of epoch {e - 2} "
                                  f"were not yet whole, e.g. {late[:3]}")
            assert e + 2 not in s['started'], f"{at}: a piece of {a} of epoch {e} came after epoch {e + 2} began"
            s['started'].add(e); s['seen'][e].add(a)
            self.cover[e, a].append((lo, hi))


def run_single(env, strategy, buffer_size, n, **kw):
    "One rank, `n` batches: the ledger, checked as it goes (every document of the rank's stream counts)."
    led = Ledger(env['lens']); s = led.stream(lambda e: env['lens'])
    with PackedLoader(env['tok'], files=env['files'], **{**KW, **kw}, strategy=strategy, buffer_size=buffer_size) as ld:
        for i in range(n):
            b = next(ld)
            led.add(s, b, strategy == 'bestfit-split', f"batch {i}")
    return led


@pytest.mark.parametrize('strategy', GUARDED)
def test_epoch_e_is_whole_before_epoch_e_plus_2(env, strategy):
    "The reproduction: a buffer larger than the dataset (64 > 38 documents) held epoch 1's documents past epoch 3's start."
    led = run_single(env, strategy, 64, 120)
    assert max(e for e, _ in led.cover) >= 5   # several epochs went by
