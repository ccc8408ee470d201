"""Issue 18 item 1 for the pre-tokenized loader (nbs/13_streaming.ipynb): an epoch ends. Contract: on one rank's stream,
every non-empty document of a dataset's epoch e is delivered (whole, or all its pieces) before any token of that
dataset's epoch e+2. Counted from `batch.segments` (document, epoch, length)."""
from collections import Counter

import pytest

from nanochat_dl.arrow import TokenRoot
from nanochat_dl.streaming import StreamingLoader
from test_streaming import toy_root

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def late_documents(loader, lens, steps):
    "Run `steps` batches; the `(dataset, file, doc, epoch)` left incomplete when a token of epoch + 2 of its dataset came."
    got, late, top = Counter(), set(), {}
    for _ in range(steps):
        b = next(loader)
        for row in b.segments:
            for s in row:
                k = s.key
                if k.epoch > top.get(k.dataset, 0):
                    top[k.dataset] = k.epoch
                    e = k.epoch - 2                  # every document of epoch e must be whole by now (epochs count from 1)
                    if e >= 1: late |= {(d, f, i, e) for (d, f, i), L in lens.items() if d == k.dataset and L and got[(d, f, i, e)] < L}
                got[(k.dataset, k.file, k.doc, k.epoch)] += s.length
    loader.close()
    return late


@pytest.fixture(scope='module')
def small(tmp_path_factory):
    r = toy_root(tmp_path_factory.mktemp('ends')/'root', {'web': {'a.arrow': 210}}, empty=0.05)
    tr = TokenRoot(r)
    return r, {('web', 'a.arrow', i): L for i, L in enumerate(tr.open('web', 'a.arrow').lens.tolist())}


# Defect reproductions (issue 18 item 1): each failed before its fix.
@pytest.mark.parametrize('pack_buffer', [1000, 64])
def test_pack_buffer_lets_no_document_wait_past_two_epochs(small, pack_buffer):
    r, lens = small
    ld = StreamingLoader(r, 64, 4, rank=0, world_size=1, n_logical_shards=8, shuffle_window=0, pack='bestfit',
                         pack_buffer=pack_buffer, prefetch=0)
    assert late_documents(ld, lens, 400) == set()


def test_shuffle_window_lets_no_document_wait_past_two_epochs(small):
    r, lens = small
    ld = StreamingLoader(r, 64, 4, rank=0, world_size=1, n_logical_shards=8, shuffle_window=40, pack='concat', prefetch=0)
    assert late_documents(ld, lens, 1500) == set()
