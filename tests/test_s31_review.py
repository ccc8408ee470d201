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


def test_epoch_plans_past_four_epochs_equal_fresh_plans(tmp_path):
    # EpochPlan keeps at most four epochs' tables; asked for epochs 1..12 out of order (evictions, epochs asked again),
    # ColumnPlan and SplitPlan give what a new plan gives for that epoch alone, and SplitPlan's order is row_group_plan's
    from nanochat_dl.testing import write_toy_shards
    from nanochat_dl.text.reader import RowGroupReader
    from nanochat_dl.text.shards import row_group_plan
    from nanochat_dl.text.stages import ColumnPlan, SplitPlan
    files = write_toy_shards(tmp_path, [[3, 4, 3, 5, 4], [6, 2, 5], [4, 3, 3, 4, 5, 3, 6]])
    es = [1, 2, 3, 4, 5, 1, 6, 7, 2, 8, 9, 10, 3, 11, 12, 12, 1, 5]
    for mode in (dict(shuffle=True, seed=4), dict(), dict(shuffle=True, seed=9, balanced=True), dict(balanced=True)):
        rd = RowGroupReader(files, 0, 1, 2, **mode)
        P = SplitPlan if rd.balanced else ColumnPlan
        plan, fg = P(rd), [(f, g) for f, n in enumerate((5, 3, 7)) for g in range(n)]
        for e in es:
            fresh = P(rd)
            assert [plan.pos(e, f, g) for f, g in fg] == [fresh.pos(e, f, g) for f, g in fg], (mode, e)
            assert plan.key([e, 1, 2, 3]) == (e, fresh.pos(e, 1, 2), 3)
            if P is SplitPlan:
                assert plan.order(e) == row_group_plan([rd._rows(f) for f in range(3)], 0, 1, e, shuffle=rd.shuffle,
                                                       seed=rd.seed, balanced=True)
            else: assert [plan.first(e, c) for c in plan.columns()] == [fresh.first(e, c) for c in fresh.columns()]
            assert len(plan._cache) <= 4
