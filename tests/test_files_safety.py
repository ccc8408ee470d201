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
    from nanochat_dl.remote import _Flock
    (tmp_path/'elsewhere').mkdir()
    (tmp_path/'x.lock').symlink_to(tmp_path/'elsewhere'/'made.txt')
    with pytest.raises(ValueError, match='x.lock is a symbolic link'):
        with _Flock(tmp_path/'x.lock'): pass
    assert os.listdir(tmp_path/'elsewhere') == []


def test_cache_cleaning_does_not_wait_on_a_fifo(tmp_path):
    "A FIFO among a cache's temp files is removed like a dead writer's temp, not opened for reading (which waits for ever)."
    os.mkfifo(tmp_path/'a.bin.5.0123.part')
    probe = "import sys; from nanochat_dl.remote import _try_remove; print(_try_remove(sys.argv[1]))"
    out = subprocess.run([sys.executable, '-c', probe, str(tmp_path/'a.bin.5.0123.part')], capture_output=True, text=True, timeout=20)
    assert out.stdout == 'True\n' and os.listdir(tmp_path) == []
