"""`nanochat-dl inspect` as a user runs it (issue 22, section 2): a loss-spike hunt from saved states. A run saves its
loader state into checkpoint folders; the command, in a subprocess, replays from the nearest state before the step
asked for and prints each row's documents, which must be those the run actually trained on at that step."""
import shutil, subprocess, sys
from pathlib import Path

import pytest

from nanochat_dl.text.loader import PackedLoader
from toytext import small_corpus
from nanochat_dl.tokens.elastic import save_loader_states
from nanochat_dl.tokens.loader import StreamingLoader

CLI = shutil.which('nanochat-dl') or str(Path(sys.executable).parent / 'nanochat-dl')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    "Both loaders' runs of 12 batches, a checkpoint folder every 4 steps, and what each step's rows held."
    d = tmp_path_factory.mktemp('inspect')
    tok = small_corpus(d)
    made = {'text': lambda: PackedLoader(tok, 4, 128, data_dir=d/'text', pack='bestfit-pad', pack_buffer=32,
                                         tokenizer_threads=1, device='cpu'),
            'tokens': lambda: StreamingLoader(d/'root', 128, 4, eos_token=tok.get_bos_token_id(), shuffle_window=50,
                                              pack='bestfit', device='cpu')}
    out = {}
    for kind, make in made.items():
        segs = []
        with make() as ld:
            for step in range(12):
                b = next(ld)
                segs.append([[(s.start, s.length, s.offset) for s in row] for row in b.segments])
                if step % 4 == 3: save_loader_states(d/kind/f'step{step}', b.state, step, rank=0, world_size=1)
        out[kind] = segs
    return d, out


def cli(*args):
    return subprocess.run([CLI, 'inspect', *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize('kind', ['text', 'tokens'])
def test_the_rows_of_a_step_are_those_trained_on(run, kind):
    d, segs = run
    data = d/'text' if kind == 'text' else d/'root'
    r = cli(d/kind, '--steps', '9..10', '--data', data, '--tokenizer-dir', d/'tok')
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == 'replaying from the state at step 8 (1 batches to step 9) ...', lines[0]
    assert lines[1].startswith('replayed 1 batches to reach step 9 in '), lines[1]
    for step in (9, 10):
        i = lines.index(f'step {step}')
        rows = [l for l in lines[i + 1:] if l.startswith('  row')][:sum(map(len, segs[kind][step]))]
        got = [(int(l.split('[')[1].split(':')[0]), l.split('tokens ')[1].split(' ')[0].rstrip(',')) for l in rows]
        want = [(a, f"{o:,}..{o + n:,}") for row in segs[kind][step] for a, n, o in row]
        assert got == want, (step, got, want)


def test_bad_input_exits_2_naming_it(run):
    d, _ = run
    for args, msg in [((d/'tokens', '--steps', '2', '--data', d/'root'), 'every state at'),
                      ((d/'tokens', '--steps', '5..4', '--data', d/'root'), 'expected 0 <= A <= B'),
                      ((d/'nowhere', '--steps', '5', '--data', d/'root'), 'no such state file'),
                      ((d/'tokens', '--data', d/'root'), '--steps A..B is needed'),
                      ((d/'tokens', '--steps', '5', '--data', d/'root', '--rank', '1'), 'hold [1] ranks: --rank 1 is none')]:
        r = cli(*args)
        assert r.returncode == 2 and msg in r.stderr and 'Traceback' not in r.stderr, (args, r.stderr)


def test_steps_the_run_skipped_are_marked(run, tmp_path):
    "A loss-spike restart: steps 5 and 6 skipped (`loader.skip(2)`); inspect over them says they were not trained on."
    d, _ = run
    tok_root, trained = d/'root', {}
    with StreamingLoader(tok_root, 128, 4, shuffle_window=50, pack='bestfit', device='cpu') as ld:
        for step in range(12):
            if step == 5: ld.skip(2)
            if step in (5, 6): continue
            b = next(ld)
            trained[step] = [[(s.start, s.length, s.offset) for s in row] for row in b.segments]
            if step in (3, 7, 11): save_loader_states(tmp_path/f'step{step}', b.state, step + 1, rank=0, world_size=1)
    r = cli(tmp_path, '--steps', '4..7', '--data', tok_root)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert 'steps 5..6 were skipped by the run (loader.skip): made, not trained on' in lines, lines[:4]
    for step in (4, 5, 6, 7):
        want = f'step {step}' + ('  (skipped: not trained on)' if step in (5, 6) else '')
        assert want in lines, (step, [l for l in lines if l.startswith('step')])
    i = lines.index('step 7')
    rows = [l for l in lines[i + 1:] if l.startswith('  row')][:sum(map(len, trained[7]))]
    got = [(int(l.split('[')[1].split(':')[0]), l.split('tokens ')[1].split(' ')[0].rstrip(',')) for l in rows]
    assert got == [(a, f"{o:,}..{o + n:,}") for row in trained[7] for a, n, o in row]
