"""Tests for nanochat_dl.pipe.transfer: shifted values, contiguity, validation, owned batches, the lifetime of views, CPU path,
CUDA guard."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanochat_dl.pipe.transfer import DeviceTransfer, SingleBufferTransfer, resolve_device

CUDA = torch.cuda.is_available()
DEVICES = ['cpu'] + (['cuda'] if CUDA else [])
needs_cuda = pytest.mark.skipif(not CUDA, reason='needs a CUDA device')


def const(B, T, v): return torch.full((B, T + 1), v, dtype=torch.long)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 6), T=st.integers(1, 40), slots=st.integers(1, 4), mode=st.sampled_from(['owned', 'copy', 'views']),
       as_numpy=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_values_are_shifted_rows(B, T, slots, mode, as_numpy, seed):
    tr = DeviceTransfer(B, T, 'cpu', slots=slots, copy=mode == 'copy', views=mode == 'views')
    rng = np.random.default_rng(seed)
    for _ in range(slots + 2):
        rows = rng.integers(0, 2**20, size=(B, T + 1), dtype=np.int64)
        x, y = tr(rows if as_numpy else torch.from_numpy(rows))
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.long
        assert x.is_contiguous() and y.is_contiguous()
        assert np.array_equal(x.numpy(), rows[:, :-1]) and np.array_equal(y.numpy(), rows[:, 1:])


@pytest.mark.parametrize('device', DEVICES)
def test_agrees_with_single_buffer_reference(device):
    g = torch.Generator().manual_seed(3)
    ref, tr = SingleBufferTransfer(3, 7, device), DeviceTransfer(3, 7, device, slots=3)
    for _ in range(5):
        rows = torch.randint(0, 1000, (3, 8), generator=g)
        (a, b), (c, d) = ref(rows), tr(rows)
        assert torch.equal(a, c) and torch.equal(b, d)


@pytest.mark.parametrize('dtype', [np.int64, np.int32, np.int16, np.uint16, np.uint8])
def test_numpy_integer_dtypes(dtype):
    rows = (np.arange(2 * 5) % 200).astype(dtype).reshape(2, 5)
    for out in (torch.long, torch.int32):
        x, y = DeviceTransfer(2, 4, 'cpu', dtype=out)(rows)
        assert x.dtype == out
        assert x.tolist() == rows[:, :-1].astype(np.int64).tolist() and y.tolist() == rows[:, 1:].astype(np.int64).tolist()


def test_non_contiguous_and_reversed_inputs():
    big = np.arange(4 * 12).reshape(4, 12)
    for rows in (big[::2, :5], big[::-1, 3:8], torch.from_numpy(big.reshape(12, 4)).t()[:, :5]):
        x, y = DeviceTransfer(rows.shape[0], 4, 'cpu')(rows)
        r = np.asarray(rows)
        assert x.tolist() == r[:, :-1].tolist() and y.tolist() == r[:, 1:].tolist()
        assert x.is_contiguous() and y.is_contiguous()


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('slots', [1, 2, 3, 5])
def test_lifetime_rule_of_views(device, slots):
    """views=True: batch i's tensors hold batch i until slot reuse: unchanged for slots-1 further puts, batch i+slots after."""
    B, T, n = 2, 3, 12
    tr = DeviceTransfer(B, T, device, slots=slots, views=True)
    out = []
    for i in range(n):
        out.append(tr(const(B, T, i)))
        for j, (x, y) in enumerate(out):
            age = i - j
            expect = j if age < slots else j + slots * (age // slots)
            assert int(x.min()) == int(x.max()) == int(y.min()) == int(y.max()) == expect, (i, j)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('kw', [dict(slots=1), dict(slots=2), dict(slots=1, copy=True)])
def test_owned_batches_never_change(device, kw):
    """The default (and the old copy=True): every batch kept stays what was put, each in storage of its own."""
    tr = DeviceTransfer(2, 3, device, **kw)
    out = [tr(const(2, 3, i)) for i in range(6)]
    assert [(int(x.min()), int(x.max()), int(y.min()), int(y.max())) for x, y in out] == [(i, i, i, i) for i in range(6)]
    assert len({x.untyped_storage().data_ptr() for x, _ in out}) == 6
    assert all(y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x, y in out)   # one buffer per batch


@settings(max_examples=30, deadline=None, derandomize=True)
@given(slots=st.integers(1, 4), n=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_a_list_of_batches_is_the_batches_put(slots, n, seed):
    """`[tr(r) for r in rows]` equals the batches taken one at a time and cloned at once, whatever the slots; with
    views=True only the last `slots` batches do (what the option means)."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 2**16, size=(3, 6)) for _ in range(n)]
    t1 = DeviceTransfer(3, 5, 'cpu', slots=slots, views=True)
    one = [tuple(t.clone() for t in t1(r)) for r in rows]            # one at a time, each cloned at once
    tr = DeviceTransfer(3, 5, 'cpu', slots=slots)
    kept = [tr(r) for r in rows]
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kept, one))
    vt = DeviceTransfer(3, 5, 'cpu', slots=slots, views=True)
    kept = [vt(r) for r in rows]
    same = [torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kept, one)]
    assert same == [i >= n - slots for i in range(n)]          # random rows: a rewritten batch differs


def test_copy_and_views_together_are_refused():
    with pytest.raises(ValueError, match='copy=True and views=True contradict each other'):
        DeviceTransfer(2, 3, 'cpu', copy=True, views=True)
    for name in ('copy', 'views'):
        for bad in ('no', 0, None):
            with pytest.raises(ValueError, match=f"{name}={bad!r} is invalid: expected True or False"):
                DeviceTransfer(2, 3, 'cpu', **{name: bad})


def test_rows_are_not_aliased():
    rows = torch.arange(10).view(2, 5)
    x, y = DeviceTransfer(2, 4, 'cpu')(rows)
    rows.fill_(-1)
    assert x.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and y.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]]


def test_cpu_path_pins_nothing_and_writes_owned_batches_straight_from_the_rows():
    tr = DeviceTransfer(3, 4, 'cpu', slots=2)
    assert tr.host_buffers == [] and tr.device_buffers == []
    x, y = tr(const(3, 4, 7))
    assert not x.is_pinned() and y.data_ptr() == x.data_ptr() + 3 * 4 * 8 and int(x.min()) == int(y.max()) == 7
    assert tr.stats()['staged_bytes'] == 2 * 3 * 4 * 8 and tr.stats()['copies'] == 0


def test_cpu_views_are_views_of_the_staging_buffer():
    tr = DeviceTransfer(3, 4, 'cpu', slots=2, views=True)
    assert [b.is_pinned() for b in tr.host_buffers] == [False, False]
    assert tr.device_buffers is tr.host_buffers
    for s in range(4):
        x, y = tr(const(3, 4, s))
        base = tr.host_buffers[s % 2].data_ptr()
        assert x.data_ptr() == base and y.data_ptr() == base + 3 * 4 * 8
    st_ = tr.stats()
    assert (st_['copies'], st_['bytes_copied'], st_['staged_bytes'], st_['batches']) == (0, 0, 4 * 2 * 3 * 4 * 8, 4)


@pytest.mark.parametrize('bad, msg', [
    (torch.zeros(2, 3, dtype=torch.long), 'rows must have shape (B, T+1) = (2, 4), got (2, 3)'),
    (torch.zeros(3, 4, dtype=torch.long), 'rows must have shape (B, T+1) = (2, 4), got (3, 4)'),
    (torch.zeros(2, 4, 1, dtype=torch.long), 'got (2, 4, 1)'),
    (np.zeros((2, 5), np.int64), 'rows must have shape (B, T+1) = (2, 4), got (2, 5)'),
    (torch.zeros(2, 4), 'integer token ids (e.g. torch.long), got torch.float32'),
    (torch.zeros(2, 4, dtype=torch.bool), 'got torch.bool'),
    (np.zeros((2, 4), np.float64), 'got numpy dtype float64'),
    ([[0] * 4] * 2, 'torch.Tensor or numpy.ndarray of shape (B, T+1) = (2, 4), got list'),
])
def test_row_validation(bad, msg):
    with pytest.raises((ValueError, TypeError)) as e: DeviceTransfer(2, 3, 'cpu')(bad)
    assert msg in str(e.value)
    with pytest.raises((ValueError, TypeError)) as e: SingleBufferTransfer(2, 3, 'cpu')(bad)
    assert msg in str(e.value)


@pytest.mark.parametrize('kw, msg', [
    (dict(B=0, T=3), 'B=0 is invalid: expected an int >= 1'),
    (dict(B=2, T=0), 'T=0 is invalid: expected an int >= 1'),
    (dict(B=2.0, T=3), 'B=2.0 is invalid: expected an int >= 1'),
    (dict(B=True, T=3), 'B=True is invalid: expected an int >= 1'),
    (dict(B=2, T=3, slots=0), 'slots=0 is invalid: expected an int >= 1'),
    (dict(B=2, T=3, dtype=torch.float16), 'dtype must be torch.int64 or torch.int32'),
    (dict(B=2, T=3, device='tpu'), "device='tpu' is not a device"),
])
def test_constructor_validation(kw, msg):
    kw.setdefault('device', 'cpu')
    with pytest.raises(ValueError, match=None) as e: DeviceTransfer(**kw)
    assert msg in str(e.value)


def test_numpy_integer_sizes_accepted():
    tr = DeviceTransfer(np.int64(2), np.int32(3), 'cpu', slots=np.int64(2))
    assert (tr.B, tr.T, tr.slots) == (2, 3, 2) and type(tr.B) is int


def test_resolve_device():
    assert resolve_device('cpu') == torch.device('cpu')
    assert resolve_device(torch.device('cpu')) == torch.device('cpu')
    assert resolve_device('auto').type == ('cuda' if CUDA else 'cpu')
    assert DeviceTransfer(1, 1, 'auto').device.type == ('cuda' if CUDA else 'cpu')


@pytest.mark.skipif(CUDA, reason='checks the error raised when CUDA is absent')
def test_cuda_requested_without_cuda_is_an_error():
    for dev in ('cuda', 'cuda:0', torch.device('cuda')):
        with pytest.raises(RuntimeError, match='CUDA is not available'): DeviceTransfer(2, 3, dev)
    with pytest.raises(RuntimeError, match='CUDA is not available'): SingleBufferTransfer(2, 3, 'cuda')


@needs_cuda
def test_cuda_pinned_values_and_stats():
    vt = DeviceTransfer(4, 64, 'cuda', slots=2, views=True)
    assert all(b.is_pinned() for b in vt.host_buffers) and len(vt.device_buffers) == 2 and all(b.is_cuda for b in vt.device_buffers)
    tr = DeviceTransfer(4, 64, 'cuda', slots=2)
    assert len(tr.host_buffers) == 2 and all(b.is_pinned() for b in tr.host_buffers) and tr.device_buffers == []
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        rows = torch.randint(0, 50_000, (4, 65), generator=g)
        x, y = tr(rows.numpy())
        assert torch.equal(x.cpu(), rows[:, :-1]) and torch.equal(y.cpu(), rows[:, 1:])
    s = tr.stats()
    assert (s['copies'], s['bytes_copied']) == (5, 5 * 2 * 4 * 64 * 8)


@needs_cuda
def test_cuda_guard_under_gpu_lag():
    """With the GPU kept busy, the single buffer loses batches and the guarded slots do not."""
    def stress(tr, n=8):
        torch.cuda.synchronize()
        seen = []
        for i in range(n):
            x, y = tr(const(tr.B, tr.T, i))
            torch.cuda._sleep(20_000_000)   # ~10 ms: the GPU lags far behind the host
            seen.append(torch.stack([x.min(), x.max(), y.min(), y.max()]))
        torch.cuda.synchronize()
        return torch.stack(seen).cpu(), torch.arange(n)[:, None].expand(n, 4)
    got, want = stress(SingleBufferTransfer(8, 256, 'cuda'))
    assert not torch.equal(got, want)
    tr = DeviceTransfer(8, 256, 'cuda', slots=2)
    got, want = stress(tr)
    assert torch.equal(got, want)
    assert tr.stats()['stalls'] > 0 and tr.stats()['wait_s'] > 0


@needs_cuda
def test_cuda_owned_batches_survive_gpu_lag():
    """Owned batches on the GPU: kept in a list while the GPU lags, each holds what was put, in storage of its own;
    views=True shows the reuse."""
    B, T, n = 8, 256, 8
    for views in (False, True):
        tr = DeviceTransfer(B, T, 'cuda', slots=2, views=views)
        torch.cuda.synchronize()
        out = []
        for i in range(n):
            out.append(tr(const(B, T, i)))
            torch.cuda._sleep(5_000_000)   # the GPU lags behind the host
        seen = [(int(x.min()), int(x.max()), int(y.min()), int(y.max())) for x, y in out]
        if views: assert seen[:-2] != [(i,) * 4 for i in range(n - 2)] and seen[-2:] == [(n - 2,) * 4, (n - 1,) * 4]
        else:
            assert seen == [(i,) * 4 for i in range(n)]
            assert len({x.untyped_storage().data_ptr() for x, _ in out}) == n
