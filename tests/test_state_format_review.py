"""Adversarial review of the streaming state format /4 (issue 21 section 2): block windows named by a cursor, packed
positions. Each test failed before the fix it names; what held is kept as tests too."""
import base64, json, time, tracemalloc, zlib

import numpy as np
import pytest

from nanochat_dl.tokens import StreamingLoader
from nanochat_dl.tokens.stream import pack_pos, unpack_pos
from test_streaming import toy_root, SPEC

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture(scope='module')
def root(tmp_path_factory): return toy_root(tmp_path_factory.mktemp('rfmt')/'root', SPEC)


def bomb(n_bytes:int) -> str:
    "A `pos` string of some hundred kilobytes that inflates to `n_bytes` (a deflate bomb in a state's field)."
    z, mb = zlib.compressobj(9), b'\0' * (1 << 20)      # deflated a megabyte at a time: the test holds no bomb
    out = [z.compress(bytes([1]) + (0).to_bytes(8, 'little'))] + [z.compress(mb) for _ in range(n_bytes >> 20)]
    return 'z' + base64.b85encode(b''.join(out) + z.flush()).decode()


def test_a_deflate_bomb_in_pos_is_refused_without_inflating_it():
    "A packed `pos` is inflated only as far as its shards need (was: all of it inflated, ~2x its size at peak)."
    s = bomb(96 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"\['pos'\]=.*expected the packed positions of 16 shards"):
            unpack_pos(s, [10] * 16, "state['datasets']['web']['pos']")
        peak = tracemalloc.get_traced_memory()[1]
    finally: tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_a_deflate_bomb_in_a_loader_state_is_refused_naming_the_field(root):
    "Through the loader: the field checks run before the checksum, so an unsealed bomb reaches `unpack_pos`."
    kw = dict(rank=0, world_size=1, n_logical_shards=16, shuffle_window=9, prefetch=0, bos_token=1)
    with StreamingLoader(root, 16, 2, **kw) as ld:
        for _ in range(5): next(ld)
        st = json.loads(json.dumps(ld.state_dict()))
    st['datasets']['web']['pos'] = bomb(96 << 20)
    tracemalloc.start()
    try:
        with StreamingLoader(root, 16, 2, **kw) as fresh:
            with pytest.raises(ValueError, match=r"\['web'\]\['pos'\]"): fresh.load_state_dict(st)
        peak = tracemalloc.get_traced_memory()[1]
    finally: tracemalloc.stop()
    assert peak < 64 << 20, peak


@pytest.mark.parametrize('pos,n', [([0] * 5, [3] * 5), ([3, 0, 7, 1], [3, 9, 7, 2]), ([], []), ([2**40], [2**41]),
                                   ([5, 5], [0, 10])])
def test_pack_pos_round_trips_and_every_truncation_is_refused(pos, n):
    "`unpack_pos(pack_pos(p))` is `p`; each shorter prefix refused (held); the string with bytes added (was loaded)."
    s = pack_pos(pos, n)
    assert unpack_pos(s, n) == pos
    for k in range(len(s)):
        with pytest.raises(ValueError): unpack_pos(s[:k], n)
    with pytest.raises(ValueError): unpack_pos(s + '000', n)       # (bytes after the deflated stream)


@pytest.mark.parametrize('field,value', [(0, 10**30), (1, 2**64 + 3), (0, 2**63)])
def test_a_window_cursor_too_big_is_refused_saying_the_bound_it_passed(root, field, value):
    "`window=[10**30, 0]` was refused as 'expected an int >= 0', which it is: the message now names the upper bound."
    kw = dict(rank=0, world_size=1, n_logical_shards=16, shuffle_window=9, prefetch=0, bos_token=1)
    with StreamingLoader(root, 16, 2, **kw) as ld:
        for _ in range(5): next(ld)
        st = json.loads(json.dumps(ld.state_dict()))
    st['datasets']['web']['window'][field] = value
    with StreamingLoader(root, 16, 2, **kw) as fresh:
        with pytest.raises(ValueError) as e: fresh.load_state_dict(st)
    assert f"['web']['window'][{field}]={value!r:.60} is invalid: expected an int >= 0 and < 2**63" in str(e.value)


def test_a_rescale_of_block_states_goes_on_with_reservoir_windows(root):
    """What happens, pinned (it was not written anywhere): a rescale merges the windows by naming their pieces, so the
    rescaled loaders go on with reservoir windows whatever their `shuffle`, and save reservoir states from then on (a
    resume on as many ranks keeps block windows). Exactly once holds (tests/test_schedule_review, check-resume)."""
    from nanochat_dl.bench.check import loader_maker, run_ranks
    make = loader_maker('tokens', root, 2, 16, shuffle_window=40, max_chunk=24, bos_token=1, n_logical_shards=12)
    _, _, st = run_ranks(make, 2, 6)
    assert all(s['config']['shuffle'] == 'block' and 'window' in s['datasets']['web'] for s in st)
    _, _, same = run_ranks(make, 2, 3, st)
    assert all(s['config']['shuffle'] == 'block' for s in same)
    _, _, st3 = run_ranks(make, 3, 3, st)
    assert all(s['config']['shuffle'] == 'reservoir' and 'shuffle' in s['datasets']['web'] for s in st3)
    _, _, st2 = run_ranks(make, 2, 3, st3)
    assert all(s['config']['shuffle'] == 'reservoir' for s in st2)
    with make(0, 2, st2) as a: rows = [next(a).rows for _ in range(4)]; mid = json.loads(json.dumps(a.state_dict()))
    with make(0, 2, st2) as a: next(a); next(a); mid = json.loads(json.dumps(a.state_dict()))
    with make(0, 2) as a: a.load_state_dict(mid); assert all(np.array_equal(next(a).rows, r) for r in rows[2:])


@pytest.mark.parametrize('stage', ['BlockWindow', 'ShuffleBuffer', 'ListSource'])
@pytest.mark.parametrize('bad', [[1, 2], None, 'x'])
def test_a_chain_refuses_a_stage_state_that_is_not_a_dict_naming_the_stage(stage, bad):
    "A chain's stage state a list, None or a string: was AttributeError (\"'list' object has no attribute 'get'\")."
    from nanochat_dl.pipe.stages import ListSource, BlockWindow, ShuffleBuffer, Chain
    cls = ShuffleBuffer if stage == 'ShuffleBuffer' else BlockWindow
    def build(): return Chain(cls(ListSource(list(range(5))), window=3))
    c = build()
    for _ in range(4): next(c)
    st = dict(c.state_dict(), **{stage: bad})
    with pytest.raises(ValueError, match=rf"\['{stage}'\] is {type(bad).__name__}: expected a dict"):
        build().load_state_dict(st)


def test_a_block_window_refuses_a_block_number_past_2_63():
    "The generic stage (a `Chain` has no checksum): `block=10**30` was loaded, its order drawn from its low bits."
    from nanochat_dl.pipe.stages import ListSource, BlockWindow, Chain
    def build(): return Chain(BlockWindow(ListSource(list(range(5))), window=3))
    c = build()
    for _ in range(4): next(c)
    st = c.state_dict()
    st['BlockWindow']['block'] = 10**30
    with pytest.raises(ValueError, match=r"window state\['block'\]=10+ is invalid: expected an int >= 0 and < 2\*\*63"):
        build().load_state_dict(st)


@pytest.mark.parametrize('stage,field', [('BlockWindow', 'block'), ('BlockWindow', 'offset'),
                                         ('ShuffleBuffer', 'drawn'), ('ShuffleBuffer', 'addresses')])
def test_a_window_state_missing_a_field_is_refused_naming_it(stage, field):
    "A window's state without its cursor or its pieces: was KeyError('block') and the like, from deep in the load."
    from nanochat_dl.pipe.stages import ListSource, BlockWindow, ShuffleBuffer, Chain
    cls = ShuffleBuffer if stage == 'ShuffleBuffer' else BlockWindow
    def build(): return Chain(cls(ListSource(list(range(5))), window=3))
    c = build()
    for _ in range(4): next(c)
    st = c.state_dict()
    del st[stage][field]
    with pytest.raises(ValueError, match=rf"state\['{field}'\]=None"): build().load_state_dict(st)


@pytest.mark.parametrize('pack', ['concat', 'bestfit'])
@pytest.mark.parametrize('win', [1, 1000])
def test_held_window_1_and_window_past_the_dataset_resume_exactly_twice_in_a_row(tmp_path, pack, win):
    "What held: 8 documents, blocks across epochs, cut, trimmed, dropped: resumed after each of 16 batches, then again."
    small = toy_root(tmp_path/'small', {'a': {'x.arrow': 5}, 'b': {'y.arrow': 3}}, seed=1)
    kw = dict(rank=0, world_size=1, n_logical_shards=4, bos_token=1, eos_token=2, pack=pack, shuffle_window=win,
              pack_buffer=4, max_chunk=5, min_length=3, strip_tokens=(1,), prefetch=0)
    with StreamingLoader(small, 16, 2, **kw) as ld:
        got = [(b.rows, json.loads(json.dumps(b.state))) for b in (next(ld) for _ in range(20))]
    for k in range(16):
        with StreamingLoader(small, 16, 2, **kw) as a:
            a.load_state_dict(got[k][1]); b = next(a); assert np.array_equal(b.rows, got[k + 1][0]), k
            st = json.loads(json.dumps(b.state))
        with StreamingLoader(small, 16, 2, **kw) as a:
            a.load_state_dict(st); assert np.array_equal(next(a).rows, got[k + 2][0]), k
