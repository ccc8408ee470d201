"""Adversarial review of session 31's changes: bestfit states naming late pieces (format /6, 'late'), `_put_all` and the
inlined bookkeeping of `BestFitRows.next_batch` against 1cf23a5's, `DeviceTransfer._put_host`'s one copy."""
import itertools, json

import numpy as np
import pytest

from nanochat_dl.pipe.state import seal
from nanochat_dl.tokens import StreamingLoader
from nanochat_dl.tokens.inputs import pack_ints, unpack_ints
from test_bestfit_state_review import CASES, SPEC, T, B, run, root, fulls   # noqa: F401 (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def resealed_late(st, lv):
    s = json.loads(json.dumps(st)); s['packer']['late'] = pack_ints(lv)
    return seal({k: x for k, x in s.items() if k != 'checksum'})


def test_a_late_piece_s_row_outside_its_pulls_is_refused(root, fulls):
    # 'late' gives per piece [number, rows since it entered, inputs numbered then]; only `rows since <= rows made` was
    # checked, so a late piece said to have entered at row 0, or at the row being made (after the next pull), loaded:
    # the next states differed from the run's (its wait, the journal) with no error. A late piece entered between the
    # pull of the input numbered before it and the next pull, and entries' rows rise in the order they entered
    full, kw = fulls['sched_pb9'], CASES['sched_pb9']
    ats = [i for i in range(60, 200) if 'late' in full[i][1]['packer']][:6]
    assert ats
    for at in ats:
        st = full[at][1]
        lv, made = unpack_ints(st['packer']['late'], 10**6, 'x')[0], st['packer']['metrics']['rows']
        for j in range(0, len(lv), 3):
            for r in {0, made} - {lv[j + 1]}:
                e = list(lv); e[j + 1] = r
                with pytest.raises(ValueError, match=r"\['late'\]"), \
                        StreamingLoader(root, T, B, prefetch=0, **kw) as ld:
                    ld.load_state_dict(resealed_late(st, e)); next(ld)
        assert run(root, kw, 1, st)[0][1] == full[at + 1][1]      # (the state as saved: still exact)
