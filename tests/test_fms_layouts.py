"""fms-fsdp's data as its users lay it out (issue 19, section 7): the counts file read as fms-fsdp reads it, where
only the `documents` column is the contract."""
import json, warnings
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.arrow import write_counts, write_token_file
from nanochat_dl.streaming import StreamingLoader

KW = dict(n_logical_shards=4, shuffle_window=3, prefetch=0, bos_token=1, rank=0, world_size=1)


def fms_root(path):
    "Two token files of short documents, and fms-fsdp's counts file (`documents` and `tokens` per file)."
    c = {('web', f'part_{f}.arrow'): write_token_file(path/'web'/f'part_{f}.arrow', [np.arange(3, 8 + (f + i) % 4) for i in range(6)])
         for f in range(2)}
    write_counts(path, c)
    return path, c


def rows(root, n=6):
    with StreamingLoader(root, 8, 2, **KW) as ld: return [next(ld).rows.tolist() for _ in range(n)]


def set_counts(root, lines):
    (root/'meta'/'combined_counts.csv').write_text('dataset/filename,documents,tokens\n' + ''.join(l + '\n' for l in lines))


def test_a_wrong_token_count_warns_and_the_file_decides(tmp_path):
    root, c = fms_root(tmp_path/'root')
    want = rows(root)
    (d0, t0), (d1, t1) = c[('web', 'part_0.arrow')], c[('web', 'part_1.arrow')]
    set_counts(root, [f'/web/part_0.arrow,{d0},{t0 + 200}', f'/web/part_1.arrow,{d1},{t1}'])
    with pytest.warns(UserWarning, match=r"part_0\.arrow: the counts file says .* tokens, the file holds"):
        assert rows(root) == want


def test_an_empty_token_count_is_accepted(tmp_path):
    root, c = fms_root(tmp_path/'root')
    want = rows(root)
    set_counts(root, [f'/web/part_{f}.arrow,{c[("web", f"part_{f}.arrow")][0]},' for f in range(2)])
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert rows(root) == want


def test_a_wrong_document_count_is_still_refused(tmp_path):
    root, c = fms_root(tmp_path/'root')
    (d0, t0), (d1, t1) = c[('web', 'part_0.arrow')], c[('web', 'part_1.arrow')]
    set_counts(root, [f'/web/part_0.arrow,{d0 + 1},{t0}', f'/web/part_1.arrow,{d1},{t1}'])
    with pytest.raises(ValueError, match=r"part_0\.arrow holds 6 documents.*the counts file says 7"):
        rows(root)


def test_rows_go_into_the_roots_own_counts_file_whatever_its_name(tmp_path):
    # fms-fsdp reads the first *counts*.csv its folder listing gives: a second file beside the root's own broke it
    from nanochat_dl.arrow import counts_files, read_counts, update_counts
    root, c = fms_root(tmp_path/'root')
    (root/'meta'/'combined_counts.csv').rename(root/'meta'/'file_counts.csv')
    update_counts(root, 'code', {'x.arrow': (4, 40)})
    assert [p.name for p in counts_files(root)] == ['file_counts.csv']
    assert read_counts(root, ['web', 'code']) == {**c, ('code', 'x.arrow'): (4, 40)}
    (root/'meta'/'more_counts.csv').write_text('dataset/filename,documents,tokens\n')
    with pytest.raises(ValueError, match=r"holds 2 counts files \(file_counts\.csv, more_counts\.csv\): fms-fsdp reads only one"):
        update_counts(root, 'code', {'x.arrow': (4, 40)})
