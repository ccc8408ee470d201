"""fms-fsdp's data as its users lay it out (issue 19, section 7): the counts file read as fms-fsdp reads it, where
only the `documents` column is the contract."""
import json, warnings
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.tokens import write_counts, write_token_file
from nanochat_dl.tokens.loader import StreamingLoader

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
    from nanochat_dl.tokens import counts_files, read_counts, update_counts
    root, c = fms_root(tmp_path/'root')
    (root/'meta'/'combined_counts.csv').rename(root/'meta'/'file_counts.csv')
    update_counts(root, 'code', {'x.arrow': (4, 40)})
    assert [p.name for p in counts_files(root)] == ['file_counts.csv']
    assert read_counts(root, ['web', 'code']) == {**c, ('code', 'x.arrow'): (4, 40)}
    (root/'meta'/'more_counts.csv').write_text('dataset/filename,documents,tokens\n')
    with pytest.raises(ValueError, match=r"holds 2 counts files \(file_counts\.csv, more_counts\.csv\): fms-fsdp reads only one"):
        update_counts(root, 'code', {'x.arrow': (4, 40)})


# --- nested dataset names (fms-fsdp's default config: 'lang=en/dataset=commoncrawl') ---------------------------------

NESTED = ('lang=en/dataset=commoncrawl', 'lang=en/dataset=wiki', 'lang=de/dataset=wikipedia')


def nested_root(path, n_docs=(12, 8, 6)):
    "fms-fsdp's layout: ROOT/lang=xx/dataset=yy/*.arrow, one counts file with full rows; a document's ids say (dataset, doc)."
    c = {}
    for k, (ds, n) in enumerate(zip(NESTED, n_docs)):
        for f in range(2):
            docs = [[100 * (k + 1) + 10 * f + i] * (2 + (i % 3)) for i in range(n // 2)]
            c[(ds, f'part_{f}.arrow')] = write_token_file(path/ds/f'part_{f}.arrow', docs)
    write_counts(path, c)
    return path, c


def delivered(ld, until_epoch=3):
    "Tokens per (dataset, file, doc, epoch) from the batches' segments, until every dataset reached `until_epoch`."
    got, seen = {}, {}
    while len(seen) < len(ld.config['datasets']) or min(seen.values()) < until_epoch:
        for row in next(ld).segments:
            for s in row:
                k = s.key
                got[k] = got.get(k, 0) + s.length
                seen[k.dataset] = max(seen.get(k.dataset, 0), k.epoch)
    return got


def test_nested_dataset_names_are_listed_and_read_each_once_per_epoch(tmp_path):
    from nanochat_dl.tokens import list_datasets, TokenRoot
    root, c = nested_root(tmp_path/'root')
    assert list_datasets(root) == sorted(NESTED)
    with TokenRoot(root) as tr:
        assert tr.datasets == sorted(NESTED)
        assert [(i.dataset, i.file, i.docs) for i in tr.files['lang=en/dataset=wiki']] == \
               [('lang=en/dataset=wiki', 'part_0.arrow', 4), ('lang=en/dataset=wiki', 'part_1.arrow', 4)]
    with StreamingLoader(root, 16, 2, **KW) as ld:
        assert ld.config['datasets'] == sorted(NESTED)
        got = delivered(ld)
    for (ds, f), (n, _) in c.items():     # every document of epochs 1 and 2 of every dataset: whole, once
        for e in (1, 2):
            lens = [got.get(k) for k in got if (k.dataset, k.file, k.epoch) == (ds, f, e)]
            assert len(lens) == n and sorted(lens) == sorted(2 + (i % 3) for i in range(n)), (ds, f, e)


def test_weights_by_nested_name_give_exact_shares(tmp_path):
    root, c = nested_root(tmp_path/'root', (400, 400, 400))
    w = {'lang=en/dataset=commoncrawl': 3, 'lang=en/dataset=wiki': 1}
    with StreamingLoader(root, 16, 4, datasets=list(w), weights=w, **KW) as ld:
        per = {}
        for _ in range(20):
            for row in next(ld).segments:
                for s in row: per[s.key.dataset] = per.get(s.key.dataset, 0) + s.length
    total = sum(per.values())
    assert set(per) == set(w)
    assert abs(per['lang=en/dataset=commoncrawl'] - total * 3 / 4) <= 4   # the deficit rule: within one document (<= 4 ids)


def test_nested_names_resume_and_explicit_parents(tmp_path):
    root, c = nested_root(tmp_path/'root')
    with StreamingLoader(root, 8, 2, **KW) as ld:
        for _ in range(3): next(ld)
        st = ld.state_dict(); want = [next(ld).rows.tolist() for _ in range(3)]
    assert set(st['datasets']) == set(NESTED)
    with StreamingLoader(root, 8, 2, **KW) as ld:
        ld.load_state_dict(st)
        assert [next(ld).rows.tolist() for _ in range(3)] == want
    with StreamingLoader(root, 8, 2, datasets=['lang=en'], **KW) as ld:        # a parent folder: one dataset of all below it
        assert ld.fingerprint['data']['lang=en']['docs'] == 20
    with pytest.raises(ValueError, match=r"datasets \['lang=en', 'lang=en/dataset=wiki'\] overlap: 'lang=en/dataset=wiki' is a folder of 'lang=en'"):
        StreamingLoader(root, 8, 2, datasets=['lang=en', 'lang=en/dataset=wiki'], **KW)
    for bad in ('../x', '/abs', 'meta', 'meta/x', 'lang=en//dataset=wiki', 'lang=en/./dataset=wiki', 'lang=en/'):
        with pytest.raises(ValueError, match="is invalid: expected a folder path under the token root"):
            StreamingLoader(root, 8, 2, datasets=[bad], **KW)
    with pytest.raises(ValueError, match=r"unknown dataset\(s\) \['lang=fr/dataset=wiki'\]"):
        StreamingLoader(root, 8, 2, datasets=['lang=fr/dataset=wiki'], **KW)


def test_a_flat_root_keeps_its_names(tmp_path):
    # a top folder holding token files itself is one dataset, with every file below it, as before
    from nanochat_dl.tokens import list_datasets, dataset_files
    write_token_file(tmp_path/'web'/'a.arrow', [[1, 2]])
    write_token_file(tmp_path/'web'/'2024'/'b.arrow', [[3]])
    write_token_file(tmp_path/'code'/'x.arrow', [[4]])
    write_token_file(tmp_path/'books'/'2023'/'a.arrow', [[5]])          # files only in subfolders: one dataset still
    write_token_file(tmp_path/'books'/'2024'/'b.arrow', [[6]])
    assert list_datasets(tmp_path) == ['books', 'code', 'web']
    assert dataset_files(tmp_path, 'web') == ['2024/b.arrow', 'a.arrow']


# --- hidden files and folders --------------------------------------------------------------------------------------

def hidden_root(path, counts=True):
    "10 documents in a visible file, 5 in a hidden file, 5 in a file under a hidden folder (fms-fsdp reads all 20)."
    c = {('web', 'a.arrow'): write_token_file(path/'web'/'a.arrow', [[1 + i, 2] for i in range(10)]),
         ('web', '.b.arrow'): write_token_file(path/'web'/'.b.arrow', [[20 + i, 3] for i in range(5)]),
         ('web', '.old/c.arrow'): write_token_file(path/'web'/'.old'/'c.arrow', [[40 + i, 4] for i in range(5)])}
    if counts: write_counts(path, c)
    return path


def test_hidden_files_listed_in_the_counts_file_are_data(tmp_path):
    from nanochat_dl.tokens import TokenRoot
    root = hidden_root(tmp_path/'root')
    with TokenRoot(root) as tr:
        assert [i.file for i in tr.files['web']] == ['.b.arrow', '.old/c.arrow', 'a.arrow']
    with StreamingLoader(root, 8, 2, **KW) as ld:
        assert ld.fingerprint['data']['web']['docs'] == 20
        assert 'skipped' not in repr(ld)
        got = delivered(ld)
    assert sorted((k.file, k.doc) for k in got if k.epoch == 1) == \
           sorted([('a.arrow', i) for i in range(10)] + [('.b.arrow', i) for i in range(5)] + [('.old/c.arrow', i) for i in range(5)])


def test_hidden_files_without_a_counts_file_are_skipped_and_said(tmp_path):
    from nanochat_dl.tokens import TokenRoot
    root = hidden_root(tmp_path/'root', counts=False)
    with TokenRoot(root) as tr:
        assert [i.file for i in tr.files['web']] == ['a.arrow']
        assert tr.skipped == {'web': ['.b.arrow', '.old/c.arrow']}
        assert "web: skipped 1 hidden file and 1 hidden folder (2 .arrow files in all" in repr(tr)
    with StreamingLoader(root, 8, 2, **KW) as ld:
        assert ld.fingerprint['data']['web']['docs'] == 10
        assert "web: skipped 1 hidden file and 1 hidden folder" in repr(ld)


# --- strip_tokens and min_length -----------------------------------------------------------------------------------

EOS = 2
SKW = dict(n_logical_shards=1, shuffle_window=0, prefetch=0, rank=0, world_size=1, pack='pad', pad_token=0)


def eos_root(path):
    "Documents that already end in EOS (2), as some pipelines write them: one only EOS, one EOS twice at each end."
    docs = [[5, 6, EOS], [7, EOS], [EOS], [8, 9, 10, EOS], [EOS, EOS, 11, EOS, EOS], [12, 13, 14, 15]]
    write_token_file(path/'web'/'a.arrow', docs)
    return path


def epochs(ld, n_rows):
    "Rows (without padding) of the next `n_rows` batches of one row, as sorted lists."
    rows = [[t for t in next(ld).rows[0].tolist() if t] for _ in range(n_rows)]
    return sorted(rows)


def test_strip_tokens_and_min_length_as_fms_fsdp(tmp_path):
    root = eos_root(tmp_path/'root')
    with StreamingLoader(root, 8, 1, eos_token=EOS, **SKW) as ld:      # without: a doubled EOS
        assert epochs(ld, 6) == sorted([[5, 6, 2, 2], [7, 2, 2], [2, 2], [8, 9, 10, 2, 2], [2, 2, 11, 2, 2, 2], [12, 13, 14, 15, 2]])
    # fms-fsdp: the first id goes if it is one of strip_tokens, then the last; then a document whose length with the
    # delimiters added is under min_length is skipped (an empty one too)
    with StreamingLoader(root, 8, 1, eos_token=EOS, strip_tokens=[EOS], min_length=3, **SKW) as ld:
        want = sorted([[5, 6, 2], [8, 9, 10, 2], [2, 11, 2, 2], [12, 13, 14, 15, 2]])
        assert epochs(ld, 4) == want and epochs(ld, 4) == want and epochs(ld, 4) == want   # epochs end: 4 rows each
        st = ld.state_dict()
    assert (st['config']['strip_tokens'], st['config']['min_length']) == ([EOS], 3)
    with StreamingLoader(root, 8, 1, eos_token=EOS, bos_token=1, strip_tokens={EOS}, min_length=4, **SKW) as ld:
        assert epochs(ld, 4) == sorted([[1, 5, 6, 2], [1, 8, 9, 10, 2], [1, 2, 11, 2, 2], [1, 12, 13, 14, 15, 2]])


def test_strip_settings_are_in_the_state_and_checked(tmp_path):
    from nanochat_dl.pipe import seal
    root = eos_root(tmp_path/'root')
    kw = dict(eos_token=EOS, **SKW)
    with StreamingLoader(root, 8, 1, strip_tokens=[EOS], min_length=3, **kw) as ld:
        next(ld); st = ld.state_dict(); want = [next(ld).rows.tolist() for _ in range(5)]
    with StreamingLoader(root, 8, 1, strip_tokens=[EOS], min_length=3, **kw) as ld:
        ld.load_state_dict(st); assert [next(ld).rows.tolist() for _ in range(5)] == want
    for other, msg in ((dict(strip_tokens=[EOS], min_length=1), "min_length=3, this loader has min_length=1"),
                       (dict(min_length=3), r"strip_tokens=\[2\], this loader has strip_tokens=\[\]")):
        with StreamingLoader(root, 8, 1, **other, **kw) as ld, pytest.raises(ValueError, match=msg): ld.load_state_dict(st)
    with StreamingLoader(root, 8, 1, **kw) as ld:                      # a state from before the settings: the defaults
        next(ld); old = ld.state_dict(); want = [next(ld).rows.tolist() for _ in range(3)]
    assert (old['config']['strip_tokens'], old['config']['min_length']) == ([], 1)
    del old['config']['strip_tokens'], old['config']['min_length']
    with StreamingLoader(root, 8, 1, **kw) as ld:
        ld.load_state_dict(seal(old)); assert [next(ld).rows.tolist() for _ in range(3)] == want
    for bad, msg in ((dict(strip_tokens=[-1]), r"strip_tokens=\[-1\] is invalid"), (dict(strip_tokens=3), "strip_tokens=3 is invalid"),
                     (dict(min_length=0), "min_length")):
        with pytest.raises(ValueError, match=msg): StreamingLoader(root, 8, 1, **bad, **kw)


def test_strip_settings_in_streaming_dataset(tmp_path):
    from nanochat_dl.tokens import StreamingDataset
    root = eos_root(tmp_path/'root')
    kw = dict(eos_token=EOS, strip_tokens=[EOS], min_length=3, **{k: v for k, v in SKW.items() if k != 'prefetch'})
    with StreamingLoader(root, 8, 1, prefetch=0, **kw) as ld: want = [next(ld).rows[0].tolist() for _ in range(8)]
    ds = StreamingDataset(root, 8, **kw)
    it = iter(ds)
    got = [next(it)[0].tolist() for _ in range(8)]
    ds.close()
    assert got == [w[:-1] for w in want]


def test_dropped_documents_count_as_read_across_a_rescale(tmp_path):
    "Two ranks with strip_tokens/min_length, resumed at one rank from both states: each kept document of epoch 1 once, no dropped one."
    docs = [[10 + i] * (i % 4) + [EOS] for i in range(40)]            # lengths 1..4, each ending in EOS: i % 4 == 0 is EOS alone
    write_token_file(tmp_path/'web'/'a.arrow', docs)
    kw = dict(eos_token=EOS, strip_tokens=[EOS], min_length=3, n_logical_shards=4, shuffle_window=3, prefetch=0, pack='concat')
    got, states = {}, []
    def take(ld, n):
        for _ in range(n):
            b = next(ld)
            for row in b.segments:
                for s in row: got[(s.key.doc, s.key.epoch)] = got.get((s.key.doc, s.key.epoch), 0) + s.length
        return b.state
    for r in range(2):
        with StreamingLoader(tmp_path, 6, 1, rank=r, world_size=2, **kw) as ld: states.append(take(ld, 3))
    with StreamingLoader(tmp_path, 6, 1, rank=0, world_size=1, **kw) as ld:
        ld.load_state_dict(states)
        while not any(e >= 3 for _, e in got): take(ld, 1)
    kept = {i: i % 4 for i in range(40) if i % 4 >= 2}                  # the unit (ids + EOS) of 3 or more ids
    for e in (1, 2): assert {d: n for (d, ep), n in got.items() if ep == e} == kept


def test_nested_names_in_the_manifest_are_verified(tmp_path):
    from nanochat_dl.tokens import TokenRoot, file_record, update_manifest, verify_dataset
    root, c = nested_root(tmp_path/'root')
    for ds in NESTED: update_manifest(root, ds, {f: file_record(root/ds/f) for d, f in c if d == ds})
    with TokenRoot(root) as tr: assert sorted(tr.manifest['datasets']) == sorted(NESTED)
    verify_dataset(root, 'lang=en/dataset=wiki')
    write_token_file(root/'lang=en'/'dataset=wiki'/'part_1.arrow', [[9, 9]] * 4)      # same count, other ids
    with pytest.raises(ValueError, match=r"lang=en/dataset=wiki/part_1\.arrow changed since .*manifest\.json recorded it"):
        TokenRoot(root)
