"""A batch belongs to its caller: `[next(loader) for _ in range(n)]` keeps the batches as they were handed out, for both
loaders and any prefetch; `views=True` gives nanochat's reused views back, and the drop-in keeps them."""
import itertools, json

import numpy as np
import pytest
import torch

from nanochat_dl.tokens import write_token_file
from nanochat_dl.dataloader import tokenizing_distributed_data_loader_bos_bestfit, tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.tokens import StreamingLoader
from nanochat_dl.testing import write_toy_shards
from nanochat_dl.text.tokenizer import Tokenizer
from toytext import words


@pytest.fixture(scope='module')
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp('own')
    files = write_toy_shards(d / 'toy', [[5, 3, 4], [2, 6, 1], [4, 4]], text_fn=words)
    tok = Tokenizer.train_from_iterator([words(f, g, r) for f in range(3) for g in range(3) for r in range(6)], 270)
    rng = np.random.default_rng(0)
    for ds, n in (('web', 3), ('code', 2)):
        for i in range(n):
            write_token_file(d / 'root' / ds / f'{i}.arrow', [rng.integers(5, 900, int(rng.integers(0, 90))) for _ in range(40)])
    return dict(dir=d, files=files, tok=tok, root=d / 'root')


def packed(env, **kw):
    return PackedLoader(env['tok'], files=env['files'], batch_size=3, seq_len=32, pack_buffer=6, tokenizer_batch_size=4, device='cpu',
                        tokenizer_threads=1, tokenize_in='threads', **kw)


def streaming(env, **kw): return StreamingLoader(env['root'], 16, 2, n_logical_shards=4, shuffle_window=7, **kw)


def kept_and_one_at_a_time(make, n=6, **kw):
    "Which of `[next(ld) for _ in range(n)]` equal the batches taken one at a time and cloned at once."
    with make(**kw) as ld: one = [(b.inputs.clone(), b.targets.clone()) for b in itertools.islice(ld, n)]
    with make(**kw) as ld: kept = [next(ld) for _ in range(n)]
    return [torch.equal(b.inputs, x) and torch.equal(b.targets, y) for b, (x, y) in zip(kept, one)], kept


@pytest.mark.parametrize('loader', ['packed', 'streaming'])
@pytest.mark.parametrize('prefetch', [0, 3])
@pytest.mark.parametrize('slots', [1, 2, 3])
def test_a_list_of_batches_is_what_was_handed_out(env, loader, prefetch, slots):
    make = lambda **kw: (packed if loader == 'packed' else streaming)(env, prefetch=prefetch, slots=slots, **kw)
    same, kept = kept_and_one_at_a_time(make)
    assert same == [True] * 6
    assert len({b.inputs.untyped_storage().data_ptr() for b in kept}) == 6
    same, _ = kept_and_one_at_a_time(make, copy=True)                 # the old way to ask: accepted, the same
    assert same == [True] * 6
    same, kept = kept_and_one_at_a_time(make, views=True)             # the option's meaning: `slots` buffers, reused
    assert same == [False] * (6 - slots) + [True] * slots
    assert len({b.inputs.untyped_storage().data_ptr() for b in kept}) == slots


@pytest.mark.parametrize('loader', ['packed', 'streaming'])
def test_copy_with_views_is_refused(env, loader):
    make = packed if loader == 'packed' else streaming
    with pytest.raises(ValueError, match='copy=True and views=True contradict each other'): make(env, copy=True, views=True)
    with pytest.raises(ValueError, match="views='no' is invalid: expected True or False"): make(env, views='no')


def test_the_dropin_keeps_nanochats_reused_views(env):
    """nanochat's loader reuses its buffers; the drop-in keeps that (views of two slots), for both functions."""
    for fn in (tokenizing_distributed_data_loader_with_state_bos_bestfit, tokenizing_distributed_data_loader_bos_bestfit):
        with fn(env['tok'], 3, 32, 'train', tokenizer_threads=1, tokenizer_batch_size=4, device='cpu', buffer_size=6,
                data_dir=env['dir'] / 'toy') as dl:
            assert dl.loader.transfer.transfer.views      # (the `TransferStage`'s `DeviceTransfer`)
            got = [next(dl) for _ in range(4)]
            assert [x.data_ptr() for x, *_ in got] == [got[0][0].data_ptr(), got[1][0].data_ptr()] * 2
            assert torch.equal(got[0][0], got[2][0]) and not torch.equal(got[0][0], got[1][0])


def test_two_threads_never_produce_on_one_stream_at_once(env):
    "`next()` from two threads: one batch is made at a time (the stream is not thread-safe), as `PackedLoader` does."
    import threading, time
    ld = streaming(env, prefetch=0)
    inside, most, lock = [0], [0], threading.Lock()
    real = ld.stream.next_rows
    def slow(B):
        with lock: inside[0] += 1; most[0] = max(most[0], inside[0])
        time.sleep(0.2)                                 # long enough for the other thread to arrive
        try: return real(B)
        finally:
            with lock: inside[0] -= 1
    ld.stream.next_rows = slow
    got = []
    ts = [threading.Thread(target=lambda: got.append(next(ld))) for _ in range(2)]
    for t in ts: t.start()
    for t in ts: t.join(30)
    ld.close()
    assert len(got) == 2 and most[0] == 1, (len(got), most[0])


# --- the adversary's round: edits of what was handed out, close() from another thread ------------------------------

def _scrub(o):
    "Overwrite every leaf of a state in place (as a careless caller might), keeping its shape."
    items = o.items() if isinstance(o, dict) else enumerate(o)
    for k, v in list(items):
        if isinstance(v, (dict, list)): _scrub(v)
        else: o[k] = -7


def _resumed(make, state, n, **kw):
    "The first `n` batches' inputs of a loader resumed from `state`."
    if make is packed:
        with make(resume_state_dict=state, **kw) as ld: return [b.inputs.clone() for b in itertools.islice(ld, n)]
    with make(**kw) as ld:
        ld.load_state_dict(state)
        return [b.inputs.clone() for b in itertools.islice(ld, n)]


@pytest.mark.parametrize('loader', ['packed', 'streaming'])
@pytest.mark.parametrize('prefetch', [0, 2])
def test_edits_of_a_batch_and_its_state_change_nothing_after(env, loader, prefetch):
    """In-place edits of a batch's tensors (add_, resize_, zero_), of its host rows, of its `state` and of what
    `state_dict()` returned leave the later batches, `state_dict()` and the resumed batches as they were."""
    make = lambda **kw: (packed if loader == 'packed' else streaming)(env, prefetch=prefetch, **kw)
    with make() as ld:
        ref = [(b.inputs.clone(), json.dumps(b.state, sort_keys=True)) for b in itertools.islice(ld, 8)]
    with make() as ld:
        for i in range(8):
            b = next(ld)
            assert torch.equal(b.inputs, ref[i][0]), f"batch {i}"
            state = b.state
            b.inputs.add_(1); b.targets.zero_(); b.inputs.resize_(1); b.packed.rows[:] = 3
            _scrub(state); _scrub(ld.state_dict())
            assert json.dumps(ld.state_dict(), sort_keys=True) == ref[i][1], f"state_dict() after batch {i}"
    state = json.loads(ref[3][1])
    assert [torch.equal(x, r) for x, (r, _) in zip(_resumed(packed if loader == 'packed' else streaming,
                                                             state, 4, env=env, prefetch=prefetch), ref[4:])] == [True] * 4


@pytest.mark.parametrize('prefetch', [0, 2])
def test_close_from_another_thread_while_streaming_next_works(env, prefetch):
    """`close()` while another thread is inside `next()` (making a batch, or waiting for one): close returns, that
    `next()` gets its batch or an error saying the loader was closed, and no token file stays mapped after close."""
    import threading, time
    ld = streaming(env, prefetch=prefetch)
    real, entered = ld.stream.next_rows, threading.Event()
    def slow(B):
        entered.set(); time.sleep(0.3)                  # the caller (or the background thread) is making a batch
        return real(B)
    ld.stream.next_rows = slow
    got = []
    def take():
        try: got.append(next(ld))
        except Exception as e: got.append(e)
    t = threading.Thread(target=take); t.start()
    assert entered.wait(10)
    ld.close()                                          # from this thread, while the other is in next()
    t.join(30)
    assert not t.is_alive() and len(got) == 1
    assert not isinstance(got[0], Exception) or 'closed' in str(got[0]), repr(got[0])
    assert ld.root._open == {}, f"{len(ld.root._open)} token files mapped after close()"
    with pytest.raises(RuntimeError, match='closed'): next(ld)


def test_state_dict_from_another_thread_during_next_is_never_stale(env):
    """`state_dict()` in a checkpointing thread while the training thread takes the next batch: afterwards
    `state_dict()` is the state after the last batch handed out, not the one being built when it came."""
    import threading, time
    ld = streaming(env, prefetch=0)
    next(ld)
    real, building = ld._full_state, threading.Event()
    def slow(snap, **kw):
        building.set(); time.sleep(0.3)                   # the checkpointing thread is building the state
        return real(snap, **kw)
    ld._full_state = slow
    t = threading.Thread(target=ld.state_dict); t.start()
    assert building.wait(10)
    ld._full_state = real
    b = next(ld)                                        # meanwhile, the training thread takes batch 2
    t.join(30)
    assert ld.state_dict()['step'] == b.state['step'] == 2
    ld.close()


@pytest.mark.parametrize('loader', ['packed', 'streaming'])
def test_a_batch_indexes_like_the_triple_it_unpacks_as(env, loader):
    # issue 19: `x, y, state = batch` worked, `batch[0]` raised TypeError
    with (packed if loader == 'packed' else streaming)(env) as ld:
        b = next(ld)
        x, y, state = b
        assert len(b) == 3 and b[0] is b.inputs and b[1] is b.targets and b[-3] is b.inputs
        assert b[2] == state and b[-1] == state and [t is u for t, u in zip(b[:2], (x, y))] == [True, True]
        with pytest.raises(IndexError): b[3]
