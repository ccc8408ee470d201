"""A token file changed under a running loader is refused by name, never read on (issue 19, section 1): rewritten in
place with fewer bytes (as `cp` does) it is an error naming the file, not a SIGBUS; rewritten at the same size too; and
loaders sharing one `TokenRoot` do not close each other's files (the root's files stay open until the last one closes)."""
import os, shutil, signal, subprocess, sys, time
from pathlib import Path

import numpy as np
import pytest

from nanochat_dl.tokens import TokenRoot, write_counts, write_token_file
from nanochat_dl.tokens.loader import StreamingLoader


def one_file_root(path, n=2000, length=500):
    "One dataset of one file of `n` documents of `length` tokens (4 MB): many pages, so a truncation leaves most unmapped."
    rec = write_token_file(Path(path)/'web'/'a.arrow', [np.arange(length, dtype=np.uint32) + i for i in range(n)])
    write_counts(path, {('web', 'a.arrow'): rec})
    return Path(path)


CHILD = """import sys
from nanochat_dl.tokens import StreamingLoader
ld = StreamingLoader(sys.argv[1], 512, 8, prefetch=int(sys.argv[2]), shuffle_window=0, pack_buffer=8)
next(ld)
print('ready', flush=True)
sys.stdin.readline()
for _ in range(2000): next(ld)
print('read on', flush=True)
"""


@pytest.mark.parametrize('prefetch', [0, 2])
def test_a_file_rewritten_in_place_with_fewer_bytes_is_an_error_naming_it_not_a_sigbus(tmp_path, prefetch):
    root = one_file_root(tmp_path/'root')
    write_token_file(tmp_path/'small.arrow', [np.arange(100, dtype=np.uint32)] * 10)   # another, smaller token file
    p = subprocess.Popen([sys.executable, '-c', CHILD, str(root), str(prefetch)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == 'ready\n', p.stderr.read()[-3000:]
        shutil.copyfile(tmp_path/'small.arrow', root/'web'/'a.arrow')   # as `cp` does: truncate, then write
        out, err = p.communicate('go\n', timeout=300)
    finally:
        if p.poll() is None: p.kill()
    assert p.returncode != -signal.SIGBUS, 'killed by SIGBUS'
    assert p.returncode == 1 and 'read on' not in out, (p.returncode, out, err[-3000:])
    last = err.strip().splitlines()[-1]
    assert str(root/'web'/'a.arrow') in last and 'changed while it was read' in last and 'by rename' in last, last
    assert 'bytes' in last, last                       # says what changed: its size


def test_a_file_rewritten_in_place_at_the_same_size_is_refused(tmp_path):
    root = one_file_root(tmp_path/'root', n=200, length=50)
    path = root/'web'/'a.arrow'
    with StreamingLoader(root, 64, 2, prefetch=0, shuffle_window=0, pack_buffer=4) as ld:
        next(ld)
        time.sleep(0.05)                               # a later modification time than the file's first write
        data = bytearray(path.read_bytes())
        at = data.find(np.arange(50, dtype=np.uint32).tobytes()[4:])     # a token of a document's bytes, changed in place
        data[at:at + 4] = np.array([7_777], dtype=np.uint32).tobytes()
        with open(path, 'r+b') as f: f.write(data)     # same size, same inode: only its contents and mtime differ
        with pytest.raises(ValueError, match=r"a\.arrow changed while it was read \(modified at .*by rename"):
            for _ in range(400): next(ld)


def test_a_file_replaced_by_rename_is_refused_when_it_is_mapped_again(tmp_path):
    "Reading on from the old mapping is safe (its inode lives on); a later open of the path finds another file: refused."
    root = one_file_root(tmp_path/'root', n=20, length=10)
    with TokenRoot(root) as r:
        first = r.open('web', 'a.arrow').doc(0).tolist()
        write_token_file(root/'web'/'a.arrow', [np.arange(10, dtype=np.uint32) + 5] * 20)   # replaced by rename, same counts
        assert r.open('web', 'a.arrow').doc(0).tolist() == first      # the old mapping reads on
        r.close()                                      # (or evicted: `max_open`) ... and mapped again
        with pytest.raises(ValueError, match=r"a\.arrow changed since this root was opened \(another file"):
            r.open('web', 'a.arrow')


def small_root(path, n_files=3, docs=6):
    c = {('web', f'p{f}.arrow'): write_token_file(path/'web'/f'p{f}.arrow', [np.arange(1, 9 + i) + 100 * f for i in range(docs)])
         for f in range(n_files)}
    write_counts(path, c)
    return path


fds = lambda: len(os.listdir('/proc/self/fd'))


@pytest.mark.parametrize('prefetch', [0, 2])
def test_closing_one_loader_leaves_another_on_the_same_root_reading(tmp_path, prefetch):
    root = small_root(tmp_path/'root')
    base = fds()
    r = TokenRoot(root)
    a, b = StreamingLoader(r, 8, 2, prefetch=prefetch), StreamingLoader(r, 8, 2, seed=1, prefetch=prefetch)
    with StreamingLoader(root, 8, 2, seed=1, prefetch=0) as alone: want = [next(alone).inputs.tolist() for _ in range(30)]
    got = [next(b).inputs.tolist()]
    next(a); a.close()
    got += [next(b).inputs.tolist() for _ in range(29)]     # was: TypeError in TokenFile.doc (a closed file's map)
    assert got == want
    assert fds() > base                                # b still holds its maps ...
    b.close()
    assert fds() == base                               # ... and the last user's close releases them
