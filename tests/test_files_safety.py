"""Files, locks and folders that cannot hurt the user (issue 19, section 2): a planted symlink or hard link never makes
a writer write elsewhere, a FIFO never hangs a reader, descriptors stay bounded, a dropped loader lets go of its files."""
import os, subprocess, sys

import pytest

from nanochat_dl.core import LOCK_FILE, folder_lock


def test_lock_file_symlink_is_refused_and_its_target_untouched(tmp_path):
    data, victim = tmp_path/'data', tmp_path/'victim.txt'
    data.mkdir(); victim.write_text('precious\n')
    (data/LOCK_FILE).symlink_to(victim)
    with pytest.raises(ValueError, match=r'\.nanochat_dl\.lock is a symbolic link'):
        with folder_lock(data): pass
    assert victim.read_text() == 'precious\n'


def test_lock_file_dangling_symlink_creates_nothing(tmp_path):
    data, victim = tmp_path/'data', tmp_path/'elsewhere'/'made.txt'
    data.mkdir(); victim.parent.mkdir()
    (data/LOCK_FILE).symlink_to(victim)
    with pytest.raises(ValueError, match='symbolic link'):
        with folder_lock(data): pass
    assert not victim.exists()


def test_lock_file_hard_link_is_refused_and_its_target_untouched(tmp_path):
    data, victim = tmp_path/'data', tmp_path/'victim.txt'
    data.mkdir(); victim.write_text('precious and long enough to see a pid written over it\n')
    os.link(victim, data/LOCK_FILE)
    with pytest.raises(ValueError, match='2 links'):
        with folder_lock(data): pass
    assert victim.read_text() == 'precious and long enough to see a pid written over it\n'


def test_lock_file_fifo_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path/LOCK_FILE)
    probe = ("import sys; from nanochat_dl.core import folder_lock\n"
             "try:\n    with folder_lock(sys.argv[1], wait_s=0.1): print('took it')\nexcept ValueError as e: print(e)")
    out = subprocess.run([sys.executable, '-c', probe, str(tmp_path)], capture_output=True, text=True, timeout=60).stdout
    assert 'is not a regular file (a FIFO)' in out and str(tmp_path/LOCK_FILE) in out


def test_lock_file_is_never_truncated_and_names_the_holder(tmp_path):
    (tmp_path/LOCK_FILE).write_text('1234567890123\n')          # a longer pid left by an earlier holder
    with folder_lock(tmp_path):
        assert (tmp_path/LOCK_FILE).read_text().split() == [str(os.getpid())]


def test_cache_lock_files_never_follow_a_planted_link(tmp_path):
    "The object-storage cache's lock files (`.lock`, `.locks/*.lock`) are lock files only: a link there creates nothing elsewhere."
    from nanochat_dl.io.cachedir import Flock
    (tmp_path/'elsewhere').mkdir()
    (tmp_path/'x.lock').symlink_to(tmp_path/'elsewhere'/'made.txt')
    with pytest.raises(ValueError, match='x.lock is a symbolic link'):
        with Flock(tmp_path/'x.lock'): pass
    assert os.listdir(tmp_path/'elsewhere') == []


def test_cache_cleaning_does_not_wait_on_a_fifo(tmp_path):
    "A FIFO among a cache's temp files is removed like a dead writer's temp, not opened for reading (which waits for ever)."
    os.mkfifo(tmp_path/'a.bin.5.0123.part')
    probe = "import sys; from nanochat_dl.io.cachedir import try_remove; print(try_remove(sys.argv[1]))"
    out = subprocess.run([sys.executable, '-c', probe, str(tmp_path/'a.bin.5.0123.part')], capture_output=True, text=True, timeout=20)
    assert out.stdout == 'True\n' and os.listdir(tmp_path) == []


# ---- token roots: only regular files are data; descriptors bounded; OS errors are not the data's ----

import numpy as np

from nanochat_dl.tokens import write_counts, write_token_file


def small_root(path, n_files=3, docs=3, counts=True, ds='web'):
    "`n_files` token files of `docs` short documents each under `path/ds` (and a counts file)."
    c = {}
    for f in range(n_files):
        c[(ds, f'part_{f:03d}.arrow')] = write_token_file(path/ds/f'part_{f:03d}.arrow',
                                                          [np.arange(1, 6 + (f + i) % 5) + 100 * f for i in range(docs)])
    if counts: write_counts(path, c)
    return path


def run_py(code, *args, timeout=120):
    return subprocess.run([sys.executable, '-c', code, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def refused_by_name(call, arg, fifo, timeout, hung):
    "Run `call` (a statement on `sys.argv[1]`) in a child, which must refuse the FIFO `fifo` by name, not hang on it."
    probe = f"import sys\ntry: {call}; print('opened')\nexcept ValueError as e: print(e)"
    try: out = run_py(probe, arg, timeout=timeout).stdout
    except subprocess.TimeoutExpired: pytest.fail(hung)
    assert f"{fifo} is a FIFO" in out, out


@pytest.mark.parametrize('counts', [True, False])
def test_a_fifo_named_arrow_is_refused_by_name_not_opened(tmp_path, counts):
    root = small_root(tmp_path/'root', counts=counts)
    os.mkfifo(root/'web'/'zz.arrow')
    refused_by_name("from nanochat_dl.tokens import StreamingLoader; StreamingLoader(sys.argv[1], 8, 2, prefetch=0)", root,
                    root/'web'/'zz.arrow', 60, 'StreamingLoader hung on a FIFO named zz.arrow')


def test_a_symlink_to_a_token_file_is_data_a_symlink_to_a_device_is_not(tmp_path):
    from nanochat_dl.tokens import TokenRoot
    root = small_root(tmp_path/'root', counts=False)
    write_token_file(tmp_path/'elsewhere.arrow', [[7, 8, 9]])
    (root/'web'/'linked.arrow').symlink_to(tmp_path/'elsewhere.arrow')
    with TokenRoot(root) as tr: assert tr.doc('web', 'linked.arrow', 0).tolist() == [7, 8, 9]
    (root/'web'/'zz.arrow').symlink_to('/dev/zero')
    with pytest.raises(ValueError, match=r"zz\.arrow is a device"): TokenRoot(root)


def test_a_full_epoch_of_300_files_under_a_256_descriptor_limit(tmp_path):
    root = small_root(tmp_path/'root', n_files=300, docs=2)
    probe = """import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from nanochat_dl.tokens import StreamingLoader, open_epochs
with StreamingLoader(sys.argv[1], 8, 4, prefetch=0, shuffle_window=0) as ld:
    n = 0
    while open_epochs(ld.state_dict())['web'] <= 1: next(ld); n += 1
    print('epoch done', n, ld.root.max_open)
"""
    out = run_py(probe, root, timeout=300)
    assert out.stdout.startswith('epoch done'), out.stderr[-2000:]
    assert 'not an Arrow IPC file' not in out.stderr


def test_an_os_error_is_not_blamed_on_the_data(tmp_path):
    "EMFILE while mapping a token file is an OSError naming the file and the limit, never 'not an Arrow IPC file'."
    root = small_root(tmp_path/'root', n_files=1)
    probe = """import resource, sys, os
from nanochat_dl.tokens import TokenFile
n = len(os.listdir('/proc/self/fd'))
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    for _ in range(100): held.append(TokenFile(sys.argv[1]))
except Exception as e: print(type(e).__name__, e)
"""
    out = run_py(probe, root/'web'/'part_000.arrow').stdout
    assert out.startswith('OSError') and 'part_000.arrow' in out and 'Too many open files' in out, out
    assert 'not an Arrow IPC file' not in out


def test_a_counts_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    from nanochat_dl.tokens import TokenRoot
    root = small_root(tmp_path/'root')
    p = root/'meta'/'combined_counts.csv'
    lines = p.read_bytes().split(b'\n')
    lines[2] = lines[2].replace(b'part', b'p\xe9rt')
    p.write_bytes(b'\n'.join(lines))
    with pytest.raises(ValueError, match=r"combined_counts\.csv, line 3: not UTF-8 text"): TokenRoot(root)


def test_a_dataset_of_weight_zero_holds_no_epoch_open(tmp_path):
    from nanochat_dl.tokens import StreamingLoader, open_epochs
    root = small_root(tmp_path/'root', ds='web')
    small_root(root, ds='code')
    with StreamingLoader(root, 8, 2, weights={'web': 1, 'code': 0}, prefetch=0) as ld:
        for _ in range(40): next(ld)
        ep = open_epochs(ld.state_dict())
    assert ep['code'] == float('inf') and ep['web'] > 1


# ---- loaders dropped without close() let go of their files at once, and say so once ----

DROP = """import gc, os, sys, warnings
gc.disable()                                    # "at once": on the last reference, not at a later collection
warnings.simplefilter('always')
fds = lambda: len(os.listdir('/proc/self/fd'))
{make}
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    first = make(); del first                   # warm-up: imports, lazily opened descriptors
    base = fds()
    for _ in range(30): make()
    after = fds()
print(base, after, sum('close()' in str(x.message) for x in w))
"""


def test_dropped_streaming_loaders_release_their_files_at_once(tmp_path):
    root = small_root(tmp_path/'root', n_files=6)
    make = f"""from nanochat_dl.tokens import StreamingLoader
def make():
    ld = StreamingLoader({str(root)!r}, 8, 2)
    for _ in range(10): next(ld)
"""
    out = run_py(DROP.format(make=make), timeout=300)
    base, after, warned = map(int, out.stdout.split())
    assert after <= base + 2 and warned == 1, (out.stdout, out.stderr[-2000:])


def test_dropped_streaming_datasets_release_their_files_at_once(tmp_path):
    root = small_root(tmp_path/'root', n_files=6)
    make = f"""from nanochat_dl.tokens import StreamingDataset
def make():
    ds = StreamingDataset({str(root)!r}, 8)
    it = iter(ds)
    for _ in range(10): next(it)
    del it
"""
    out = run_py(DROP.format(make=make), timeout=300)
    base, after, warned = map(int, out.stdout.split())
    assert after <= base + 2 and warned == 1, (out.stdout, out.stderr[-2000:])


def test_dropped_packed_loaders_release_their_files_at_once(tmp_path):
    from nanochat_dl.testing import write_toy_shards
    from nanochat_dl.text.tokenizer import train_tokenizer
    write_toy_shards(tmp_path/'data', [[20, 20], [20, 20], [20]])
    train_tokenizer(tmp_path/'data', vocab_size=270, out_dir=tmp_path/'tok', progress=False)
    make = f"""from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.text.tokenizer import get_tokenizer
tok = get_tokenizer({str(tmp_path/'tok')!r})
def make():
    ld = PackedLoader(tok, 2, 32, 'train', {str(tmp_path/'data')!r}, tokenizer_threads=1, tokenize_in='threads', device='cpu')
    for _ in range(3): next(ld)
"""
    out = run_py(DROP.format(make=make), timeout=300)
    base, after, warned = map(int, out.stdout.split())
    assert after <= base + 2 and warned == 1, (out.stdout, out.stderr[-2000:])


def test_a_fifo_named_parquet_in_a_shard_folder_is_refused_by_name(tmp_path):
    "The text half too: a FIFO named like a shard is refused naming it, never opened (which waits for a writer for ever)."
    from nanochat_dl.testing import write_toy_shards
    write_toy_shards(tmp_path/'data', [[20, 20], [20, 20], [20]])
    os.mkfifo(tmp_path/'data'/'shard_00001x.parquet')
    refused_by_name("from nanochat_dl.text.shards import split_shards; split_shards('train', sys.argv[1])", tmp_path/'data',
                    tmp_path/'data'/'shard_00001x.parquet', 60, 'a FIFO named *.parquet hung the shard listing')


def test_a_fifo_as_the_manifest_is_refused_by_name(tmp_path):
    root = small_root(tmp_path/'root')
    os.mkfifo(root/'meta'/'manifest.json')
    refused_by_name("from nanochat_dl.tokens import TokenRoot; TokenRoot(sys.argv[1])", root, root/'meta'/'manifest.json', 20,
                    'TokenRoot hung on a FIFO named manifest.json')
