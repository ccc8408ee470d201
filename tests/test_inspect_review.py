"""Review of `nanochat-dl inspect`'s skipped steps (`run_skipped`): which state's `skipped` runs are read, and a
malformed record refused naming the file that holds it (exit 2, one line, no traceback)."""
import json, os

import pytest

from nanochat_dl.bench.replay import inspect_cli, run_skipped, skip_notes
from nanochat_dl.tokens.elastic import save_loader_states, loader_state_path


NONE = object()


def state(step, skipped=NONE):
    st = {'format': 'nanochat_dl.streaming/1', 'step': step, 'config': {}}
    return st if skipped is NONE else dict(st, skipped=skipped)


@pytest.mark.parametrize('bad', ['x', None, [[-1, 2]], [[2, 3], [4, 1]], [[8, 5]], [[2, 0]], [[2, True]], [[2]]])
def test_a_malformed_skipped_names_its_file(tmp_path, capsys, bad):
    "A folder of checkpoints whose latest state's `skipped` is malformed: exit 2, the message names the state file."
    save_loader_states(tmp_path/'step4', state(4), 4, rank=0, world_size=1)
    save_loader_states(tmp_path/'step10', state(10, bad), 10, rank=0, world_size=1)
    assert inspect_cli(str(tmp_path), steps='4..5', data=str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'Traceback' not in err, err
    assert str(loader_state_path(tmp_path/'step10', 0, 1)) in err, err


def test_a_malformed_skipped_names_its_file_single_and_rank(tmp_path):
    (tmp_path/'one.json').write_text(json.dumps(state(10, [[8, 5]])))
    with pytest.raises(ValueError, match=str(tmp_path/'one.json')): run_skipped(tmp_path/'one.json')
    for r in range(2): save_loader_states(tmp_path/'step10', state(10, [[2, 1]] if r else 'x'), 10, rank=r, world_size=2)
    assert run_skipped(tmp_path, rank=1) == [[2, 1]]
    with pytest.raises(ValueError, match='rank00000'): run_skipped(tmp_path, rank=0)


def test_equal_steps_the_later_save_is_read(tmp_path):
    "A restart's second attempt saved at the same step as the first, in another folder: its record (written later)."
    save_loader_states(tmp_path/'b_first', state(8), 8, rank=0, world_size=1)
    save_loader_states(tmp_path/'a_retry', state(8, [[5, 2]]), 8, rank=0, world_size=1)
    os.utime(loader_state_path(tmp_path/'b_first', 0, 1), (1e9, 1e9))
    os.utime(loader_state_path(tmp_path/'a_retry', 0, 1), (2e9, 2e9))
    assert run_skipped(tmp_path) == [[5, 2]]
    os.utime(loader_state_path(tmp_path/'a_retry', 0, 1), (5e8, 5e8))   # written first: the other one is the later
    assert run_skipped(tmp_path) == []


def test_a_restart_the_latest_step_is_read(tmp_path):
    "First attempt saved 4, 8 (no skip); restart from 4 skipping 5..6; second attempt saved 12: its record is read."
    save_loader_states(tmp_path/'step4', state(4), 4, rank=0, world_size=1)
    save_loader_states(tmp_path/'step8', state(8), 8, rank=0, world_size=1)
    save_loader_states(tmp_path/'step12', state(12, [[5, 2]]), 12, rank=0, world_size=1)
    assert run_skipped(tmp_path) == [[5, 2]]
    drop = {'pq_idx': 0, 'rg_idx': 0, 'epoch': 1, 'at_batch': state(7, [[5, 2]])}
    (tmp_path/'dropin.json').write_text(json.dumps(drop))
    assert run_skipped(tmp_path/'dropin.json') == [[5, 2]]


def test_notes_partly_overlapping():
    runs = [[2, 3], [9, 1]]
    assert skip_notes(runs, 4, 9) == ['steps 2..4 were skipped by the run (loader.skip): made, not trained on',
                                      'steps 9..9 were skipped by the run (loader.skip): made, not trained on']
    assert skip_notes(runs, 0, 1) == [] and skip_notes(runs, 5, 8) == [] and len(skip_notes(runs, 0, 2)) == 1


def test_a_rank_gone_after_a_rescale_still_sees_the_later_skips(tmp_path):
    "4 ranks saved at 8, steps 9..10 skipped, rescaled to 2 ranks saved at 12: --rank 3 over 8..11 marks 9..10."
    for r in range(4): save_loader_states(tmp_path/'step08', state(8), 8, rank=r, world_size=4)
    for r in range(2): save_loader_states(tmp_path/'step12', state(12, [[9, 2]]), 12, rank=r, world_size=2)
    assert run_skipped(tmp_path, rank=3) == [[9, 2]]
    assert run_skipped(tmp_path, rank=1) == [[9, 2]] and run_skipped(tmp_path/'step08', rank=3) == []
