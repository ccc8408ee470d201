"""A real two-process job: `torchrun --nproc_per_node 2` on the gloo backend (CPU). Each rank streams batches from the
drop-in loader, which finds its rank and world size in the initialised process group; the ranks then gather the
addresses of every document they placed and check that no document reached both, and that each rank's stream is
exactly that of a single-process loader built for its rank."""
import json, os, shutil, subprocess, sys, textwrap
from pathlib import Path

import pytest

from nanochat_dl.text.sample import make_sample_shards
from nanochat_dl.text.tokenizer import train_tokenizer

WORKER = """
import json, os, sys, itertools, torch
import torch.distributed as dist
from nanochat_dl.text.loader import PackedLoader
from nanochat_dl.dataloader import tokenizing_distributed_data_loader_with_state_bos_bestfit
from nanochat_dl.text.tokenizer import Tokenizer

dist.init_process_group('gloo')
rank, world = dist.get_rank(), dist.get_world_size()
os.environ.pop('RANK'); os.environ.pop('WORLD_SIZE')        # the loader must take them from the process group
tok = Tokenizer.load(sys.argv[1])
B, T, n = 4, 256, 25
stream = tokenizing_distributed_data_loader_with_state_bos_bestfit(tok, B, T, 'train', device='cpu', buffer_size=100)
mine, digests, states = set(), [], []
for _ in range(n):
    x, y, s = next(stream)
    digests.append(hash((x.numpy().tobytes(), y.numpy().tobytes())))
    states.append(s)
stream.close()
# which documents this rank placed: from a loader built explicitly for this rank, checked to give the same batches
with PackedLoader(tok, B, T, 'train', device='cpu', pack_buffer=100, rank=rank, world_size=world) as ld:
    for i, b in enumerate(itertools.islice(ld, n)):
        assert hash((b.inputs.numpy().tobytes(), b.targets.numpy().tobytes())) == digests[i], f"rank {rank}: batch {i} differs"
        mine |= {tuple(s.key[1:]) for row in b.segments for s in row}
everyone = [None] * world
dist.all_gather_object(everyone, sorted(mine))
if rank == 0:
    sets = [set(map(tuple, d)) for d in everyone]
    out = dict(world=world, docs=[len(s) for s in sets], shared=len(sets[0] & sets[1]),
               rgs=[sorted({g % world for _, g, _ in s}) for s in sets],
               state_ranks=[states[-1]['at_batch']['config']['rank']], epochs=states[-1]['epoch'])
    print('RESULT ' + json.dumps(out), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(300)
def test_two_ranks_never_share_a_document(tmp_path):
    torchrun = shutil.which('torchrun') or str(Path(sys.executable).parent / 'torchrun')
    if not Path(torchrun).exists(): pytest.skip('torchrun is not installed')
    data = tmp_path / 'base_data'
    make_sample_shards(data)
    train_tokenizer(data, vocab_size=1024, out_dir=tmp_path / 'tok', progress=False)
    script = tmp_path / 'worker.py'
    script.write_text(textwrap.dedent(WORKER))
    env = dict(os.environ, NANOCHAT_DL_DATA_DIR=str(data), OMP_NUM_THREADS='1')
    r = subprocess.run([torchrun, '--standalone', '--nproc_per_node', '2', str(script), str(tmp_path / 'tok')],
                       capture_output=True, text=True, env=env, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    line = [l for l in r.stdout.splitlines() if l.startswith('RESULT ')]
    assert line, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(line[-1][7:])
    assert res['world'] == 2
    assert min(res['docs']) > 100                    # both ranks really placed documents
    assert res['shared'] == 0                        # and never the same one
    assert res['rgs'] == [[0], [1]]                  # rank r reads row groups r, r+2, r+4, ...
