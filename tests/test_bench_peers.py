"""The peer benchmark's harness on each peer that is installed (the `bench` extra), on a tiny data set: each loader
reads back the rows its writer wrote, resumes to the same next batches on 1 and 2 ranks, and its measurements come
back complete. Peers that are not installed are skipped; ours always runs."""
import numpy as np
import pytest

from nanochat_dl.bench.peers import PEERS, REFERENCE, available, bench_peer, bench_peers, peer_data, peer_table


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return peer_data(32, tmp_path_factory.mktemp('peers'), datasets={'web': (2, 20)}, out=None)


@pytest.mark.parametrize('peer', ['mosaic', 'litdata', 'torchdata', 'ours-concat'])
def test_peer(peer, data, tmp_path):
    if not available(peer): pytest.skip(f"{peer} is not installed (pip install -e '.[bench]')")
    r = bench_peer(peer, data, B=4, T=32, window=30, work=tmp_path, out=None)
    assert r['exact_1'] and r['exact_2'], r                      # the next batches after a resume, on 1 and 2 ranks
    assert all(r[k] > 0 for k in ('state_bytes_1', 'tokens_per_s_1', 'tokens_per_s_2', 'rss0_mib_1', 'peak_mib_1', 'resume_s_1')), r   # measured
    assert r['epoch']['unknown'] == 0 and r['epoch']['total'] == (data['rows'] if peer in ('mosaic', 'litdata', 'torchdata') else 40)
    if peer.startswith('ours'): assert r['epoch']['once'], r['epoch']    # one uninterrupted epoch: every document once
    rs = r['rescale']
    assert rs['supported'] is False or rs['unknown'] == 0
    if peer.startswith('ours'): assert rs['supported'] and rs['once'], rs    # 2 ranks' half epoch finished by 1 rank: every document once
    assert peer_table(dict(results=[r])).count('\n') == 2


def test_a_peer_chosen_alone_is_compared_with_ours(tmp_path):
    "`--peers perdoc` still measures the reference (ours-concat) on the same tokens, and the table gives the ratio to it."
    r = bench_peers(['perdoc', 'perdoc'], B=4, T=32, window=30, path=tmp_path, datasets={'web': (2, 20)}, out=None)
    assert [x['peer'] for x in r['results']] == ['perdoc', REFERENCE]
    ref, other = r['results'][1]['tokens_per_s_1'], r['results'][0]['tokens_per_s_1']
    rows = peer_table(r).splitlines()
    assert rows[0].split(' | ')[2] == f'/ {REFERENCE}'
    assert rows[2].split(' | ')[2] == f'{other / ref:.2f}x' and rows[3].split(' | ')[2] == '1.00x'
