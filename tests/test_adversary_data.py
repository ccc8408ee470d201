"""Adversarial checks of issue 19's data work (tokenize's defaults, nested names, strip_tokens/min_length, token files
changed under a running loader): each test here failed before the fix named in its docstring."""
import threading
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.arrow import TokenRoot, write_token_file
from nanochat_dl.streaming import StreamingLoader, TokenStream


def many_files_root(path, n_files=8, n_docs=50):
    "One dataset of `n_files` small files of random documents (ids 3..99), some ending in EOS (2)."
    rng = np.random.default_rng(0)
    for f in range(n_files):
        docs = [rng.integers(3, 100, rng.integers(1, 20)).tolist() + [2] * int(rng.integers(0, 2)) for _ in range(n_docs)]
        write_token_file(Path(path)/'web'/f'f{f}.arrow', docs)
    return Path(path)


def _rows(root, slow, seed, n, **kw):
    "The first `n` batches (lists) of a loader of `root` (a path or a shared `TokenRoot`)."
    with StreamingLoader(root, 16, 2, seed=seed, n_logical_shards=4, shuffle_window=0, prefetch=0, rank=0, world_size=1,
                         **kw) as ld:
        if slow: ld.stream = TokenStream(ld.root, ld.config)
        return [next(ld).rows.tolist() for _ in range(n)]


@pytest.mark.parametrize('trim', [{}, dict(strip_tokens=[2], min_length=4)])
def test_loaders_sharing_a_root_of_max_open_1_in_threads(tmp_path, trim):
    """Loaders in threads sharing one `TokenRoot` that keeps one file open: one's open evicts the file another just
    got, before it reads it. Before the fix: `ValueError: .../f4.arrow: read after close()` (and with strip_tokens a
    `TypeError` from the cut of an evicted file). Now each loader's batches are those it makes alone."""
    path = many_files_root(tmp_path/'root')
    n, runs = 400, [(s, s % 2 == 1) for s in range(4)]
    want = {r: _rows(path, r[1], r[0], n, **trim) for r in runs}
    root, got, errs = TokenRoot(path, max_open=1), {}, []
    def run(seed, slow):
        try: got[seed, slow] = _rows(root, slow, seed, n, **trim)
        except Exception as e: errs.append(f"{type(e).__name__}: {e}")
    ts = [threading.Thread(target=run, args=r) for r in runs]
    for t in ts: t.start()
    for t in ts: t.join(120)
    assert errs == [] and got == want
