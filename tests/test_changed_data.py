"""Changed data is caught (issue 19, section 1): the default file check and the resume fingerprint see every token of
every file, once per version of the file, with or without a manifest."""
import json, os, time
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.tokens import TokenRoot, file_record, update_manifest, verify_dataset, write_counts, write_token_file
from nanochat_dl.tokens.loader import StreamingLoader


def big_root(path, n=3000, manifest=True):
    "One dataset of one file of `n` documents: over ~2,730 its index alone fills the last 64 KiB."
    docs = [np.arange(i % 7 + 3, dtype=np.uint32) + 1_000_000 + 10 * i for i in range(n)]   # distinct bytes
    rec = write_token_file(Path(path)/'web'/'a.arrow', docs)
    write_counts(path, {('web', 'a.arrow'): rec})
    if manifest: update_manifest(path, 'web', {'a.arrow': file_record(Path(path)/'web'/'a.arrow')})
    return Path(path)


def flip_first_token(path):
    "Replace the first document's first token in place (same size): the bytes of a record batch, far from the file's end."
    with TokenRoot(path.parent.parent) as r: first = int(r.open('web', 'a.arrow').doc(0)[0])
    data = bytearray(path.read_bytes())
    at = data.find(np.array([first, first + 1], dtype=np.uint32).tobytes())
    assert at > 0 and at < len(data) - 100_000
    data[at:at + 4] = np.array([first + 99], dtype=np.uint32).tobytes()
    st = path.stat()
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))      # even with its old modification time
    with TokenRoot(path.parent.parent, verify='off') as r: assert int(r.open('web', 'a.arrow').doc(0)[0]) == first + 99


def test_a_changed_token_is_refused_by_the_default_check(tmp_path, monkeypatch):
    monkeypatch.setenv('NANOCHAT_DL_BASE_DIR', str(tmp_path/'cache'))
    root = big_root(tmp_path/'root')
    verify_dataset(root, 'web')                                # as written: passes (and its hash is kept)
    flip_first_token(root/'web'/'a.arrow')
    for check in (lambda: verify_dataset(root, 'web'), lambda: verify_dataset(root, 'web', 'quick'), lambda: TokenRoot(root)):
        with pytest.raises(ValueError, match=r"a\.arrow changed since .*manifest.json recorded it \(its sha256 differs"): check()


def test_a_wrong_manifest_hash_is_refused_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv('NANOCHAT_DL_BASE_DIR', str(tmp_path/'cache'))
    root = big_root(tmp_path/'root')
    m = json.loads((root/'meta'/'manifest.json').read_text())
    m['datasets']['web']['files']['a.arrow']['sha256'] = '0' * 64
    (root/'meta'/'manifest.json').write_text(json.dumps(m))
    with pytest.raises(ValueError, match='its sha256 differs'): TokenRoot(root)


def test_without_a_manifest_a_state_saved_before_a_change_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv('NANOCHAT_DL_BASE_DIR', str(tmp_path/'cache'))
    root = big_root(tmp_path/'root', manifest=False)
    with StreamingLoader(root, 8, 2, prefetch=0, shuffle_window=0) as ld:
        next(ld); sd = json.loads(json.dumps(ld.state_dict()))
    flip_first_token(root/'web'/'a.arrow')
    with StreamingLoader(root, 8, 2, prefetch=0, shuffle_window=0) as ld:
        with pytest.raises(ValueError, match="dataset 'web' differs"): ld.load_state_dict(sd)


def test_an_unchanged_file_is_hashed_once(tmp_path, monkeypatch):
    monkeypatch.setenv('NANOCHAT_DL_BASE_DIR', str(tmp_path/'cache'))
    root = big_root(tmp_path/'root')
    import nanochat_dl.tokens.meta as meta
    calls = []
    real = meta.sha256_of_file
    monkeypatch.setattr(meta, 'sha256_of_file', lambda p: calls.append(p) or real(p))
    for _ in range(3): TokenRoot(root).close()
    assert len(calls) == 1                                         # once, then from the hash cache
    verify_dataset(root, 'web', 'full')                            # 'full' hashes again, whatever is cached
    assert len(calls) == 2
    p = root/'web'/'a.arrow'
    p.write_bytes(p.read_bytes())                                  # the same bytes, a new version of the file: hashed again
    TokenRoot(root).close()
    assert len(calls) == 3
