"""One phase of an elastic run under `torchrun` (gloo, CPU), for tests/test_elastic.py.

usage: python -m torch.distributed.run --nproc_per_node N elastic_ddp.py ROOT OUT PHASE STEPS [RESUME_FROM]

Each rank builds a `StreamingLoader` (its rank and world size from the process group), resumes from the loader
states of every rank saved in RESUME_FROM (saved at any world size), takes STEPS batches (-1: until its first epoch
is closed), writes every document segment it delivered to OUT/PHASE/segments.rankR.json, and saves its state
with `save_loader_states` in OUT/PHASE/ckpt."""
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from nanochat_dl.tokens import StreamingLoader, open_epochs
from nanochat_dl.tokens import save_loader_states, load_loader_states

KW = dict(weights=[1, 2, 3], bos_token=1, eos_token=2, sep_token=3, n_logical_shards=12, shuffle_window=10,
          max_chunk=40, pack='bestfit', pack_buffer=8, seed=5)

def first_epoch_closed(state) -> bool:
    "Nothing of epoch 1 is left on this rank: no shard, cut, window or packer entry still in it (`open_epochs`)."
    return min(open_epochs(state).values()) > 1

def main(root, out, phase, steps, resume=None):
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    here = Path(out) / phase
    ld = StreamingLoader(root, 16, 2, **KW)                       # prefetch on: the state must be that of the batch taken
    assert (ld.config['rank'], ld.config['world_size']) == (rank, world)
    if resume: ld.load_state_dict(load_loader_states(resume))   # every rank's state, saved at any world size
    segs, n = [], 0
    while steps < 0 or n < steps:
        if steps < 0 and first_epoch_closed(ld.state_dict()): break
        b = next(ld)
        segs += [[s.key.dataset, s.key.file, s.key.doc, s.key.epoch, s.offset, s.length] for row in b.segments for s in row]
        n += 1
    state = ld.state_dict()
    ld.close()
    (here).mkdir(parents=True, exist_ok=True)
    (here / f'segments.rank{rank}.json').write_text(json.dumps(dict(rank=rank, world=world, batches=n, segments=segs)))
    save_loader_states(here / 'ckpt', state, state['step'])
    dist.barrier()
    dist.destroy_process_group()

if __name__ == '__main__':
    a = sys.argv[1:]
    main(a[0], a[1], a[2], int(a[3]), a[4] if len(a) > 4 else None)
