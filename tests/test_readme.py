"""Every example in README.md runs as written (issue 19, section 6), on the demo's data, as a new user meets them.

The `sh` and `python` blocks run in the README's order in one fresh HOME: the shell blocks as commands, the Python
blocks in one namespace (a later block uses what an earlier one made, as a reader would type them). What the test
adds is said here and nowhere else: the fresh-machine commands run without their venv and `pip install` steps (the
package is installed already; `.ci/run` runs the test command itself, so that block is not run twice); a moto S3
server on 127.0.0.1 stands in for `s3://my-bucket`, and the demo's shards are uploaded under `base_data/` there, as a
user's bucket would hold them; the lines meant for nanochat's `base_train.py` get that script's names (`ddp`,
`ddp_world_size`, `dataloader_state_dict`). After each block, what the README says it gives is checked."""
import os, re, subprocess, sys, textwrap
from pathlib import Path

import pytest

from s3util import MotoServer, s3_env

README = Path(__file__).resolve().parents[1]/'README.md'
BLOCK = re.compile(r'^```(sh|python)\n(.*?)^```', re.M | re.S)
SETUP = ('python3 -m venv', '. .venv/bin/activate', 'pip install')   # fresh-machine steps this test does not repeat


def readme_blocks(text=None) -> list:
    "The README's runnable blocks in order, as (kind, code)."
    return [(m[1], m[2]) for m in BLOCK.finditer(text if text is not None else README.read_text())]


def shell_steps(code) -> list:
    "A shell block's commands, without the fresh-machine setup steps; None for the test command itself."
    steps = [s.strip() for line in code.splitlines() if line.strip() and not line.lstrip().startswith('#')
             for s in line.split('&&')]
    steps = [s for s in steps if not s.startswith(SETUP)]
    if any(s.startswith(('nbdev-test', 'pytest')) for s in steps): return None
    return steps


def test_the_blocks_are_found_and_read():
    kinds = [k for k, _ in readme_blocks()]
    assert kinds.count('python') >= 6 and kinds.count('sh') >= 4, kinds
    assert shell_steps('python3 -m venv .venv && . .venv/bin/activate && pip install -e . && nanochat-dl demo') == [
        'nanochat-dl demo']
    assert shell_steps('pip install -e ".[dev]" && nbdev-test --n-workers 2 && pytest -q tests') is None
    ci = (README.parent/'.ci'/'run').read_text().strip().splitlines()[-1]     # CI runs the README's test command
    assert [c for c in readme_blocks() if 'pytest' in c[1]][0][1].strip().endswith(ci), ci
    assert readme_blocks('x\n```python\na = 1\n```\n```\nout\n```\n```sh\nls\n```\n') == [('python', 'a = 1\n'),
                                                                                           ('sh', 'ls\n')]


# What the README says each block gives, checked after it (keyed by a line of the block).
CHECKS = {
    'x, y, state = next(loader)': "assert tuple(x.shape) == tuple(y.shape) == (32, 2048) and (x[:, 1:] == y[:, :-1]).all()"
                                  "\nassert set(state) >= {'pq_idx', 'rg_idx', 'epoch', 'at_batch'}",
    'all_states = [None] * ddp_world_size': "assert all_states == [dataloader_state_dict]",
    'report = loader.skip(2)': "assert report['steps'] == [10, 11] and step12.state['skipped'] == [[10, 2]]"
                               "\nassert step12.state['step'] == 13",
    'weights=anneal': "assert m['target_shares'] == {'web': 0.5, 'web-val': 0.5} and m['tokens_seen'] > 60_000"
                      "\nassert all(abs(m['target_total_shares'][d] - m['total_shares'][d]) * m['tokens_seen'] <= 256"
                      " for d in m['shares'])   # within (K-1) x L of the schedule's integral (K=2, L=256)",
    'zip(range(100), loader)': "assert step == 99 and tuple(x.shape) == (32, 2048) and 'oldest_wait' in batch.metrics",
    'batch = next(loader)': "assert tuple(batch.inputs.shape) == (8, 2048) and 'checksum' in state",
    'StreamingLoader("s3://my-bucket/tokens"': "assert next(loader)[0].shape == (32, 2048)"
                                               "\nwith StreamingLoader('s3://my-bucket/tokens', 2048, 8) as ld: "
                                               "assert next(ld).inputs.shape == (8, 2048)",
    'loader.load_state_dict(': "with PackedLoader(tok, 32, 2048) as ref: want = [next(ref) for _ in range(step + 2)][-1]"
                               "\nassert (next(loader)[0] == want[0]).all(); loader.close()",
}
CHECKS['hf.save("my_tokenizer.json")'] = (   # the BOS found among its special tokens, the fingerprint in the state
    "assert (first.inputs[:, 0] == hf.token_to_id('<|bos|>')).all() and first.inputs.shape == (8, 512)"
    "\nassert first.state['fingerprint']['tokenizer'] == as_tokenizer(hf).fingerprint()")
CHECKS['TokenRoot("~/tokens-hf"'] = (   # the manifest names the tokenizer; this package's own is refused there
    "from nanochat_dl import get_tokenizer\nimport pytest"
    "\nwith pytest.raises(ValueError, match='tokenized with another tokenizer'): TokenRoot('~/tokens-hf', "
    "tokenizer=get_tokenizer())")
GIVEN = {'all_states = [None] * ddp_world_size': "ddp, ddp_world_size, dataloader_state_dict = False, 1, state"}

DRIVER = r'''
import json, os, subprocess, sys
blocks, checks, given = json.load(open(sys.argv[1]))
ns = {}
for i, (kind, code, label) in enumerate(blocks):
    print(f"--- block {i} ({kind}): {label}", flush=True)
    if kind == 'sh':
        for cmd in code:
            if cmd.startswith('export '):                 # one shell session: later blocks see it, '~' expanded
                name, _, value = cmd[len('export '):].partition('=')
                os.environ[name.strip()] = os.path.expanduser(os.path.expandvars(value.strip()))
                continue
            r = subprocess.run(cmd, shell=True)
            if r.returncode: sys.exit(f"block {i}: `{cmd}` exited {r.returncode}")
        continue
    for key, pre in given.items():
        if key in code: exec(pre, ns)
    exec(compile(code, f"README block {i}", 'exec'), ns)
    for key, check in checks.items():
        if key in code: exec(check, ns)
print("ALL BLOCKS RAN", flush=True)
'''


def _upload_shards(srv, base):
    "The demo's shards under `s3://my-bucket/base_data/`, as a user's bucket would hold them."
    srv.put('my-bucket', {f'base_data/{p.name}': p.read_bytes() for p in sorted(base.glob('*.parquet'))})


def test_every_readme_example_runs_as_written(tmp_path):
    home = tmp_path/'home'; home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(('NANOCHAT', 'AWS_'))}
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join([str(README.parent), env.get('PYTHONPATH', '')]))
    blocks, ran_demo = [], False
    with MotoServer() as srv:
        env.update(s3_env(srv.endpoint))
        srv.put('my-bucket', {})
        for kind, code in readme_blocks():
            steps = shell_steps(code) if kind == 'sh' else code
            if steps is None: continue
            label = textwrap.shorten(code.strip().splitlines()[-1], 90)
            blocks.append((kind, steps, label))
        # the demo (the first block) makes the data every later block uses: run it, then upload its shards
        first = blocks.pop(0)
        assert first[1] == ['nanochat-dl demo'], first
        r = subprocess.run(first[1][0], shell=True, cwd=home, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert 'resume check' in r.stdout and 'PASS' in r.stdout, r.stdout[-2000:]
        _upload_shards(srv, home/'.cache'/'nanochat_dl'/'base_data')
        spec = tmp_path/'blocks.json'
        import json
        spec.write_text(json.dumps([blocks, CHECKS, GIVEN]))
        r = subprocess.run([sys.executable, '-c', DRIVER, str(spec)], cwd=home, env=env, capture_output=True,
                           text=True, timeout=1500)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and out.count('--- block') == len(blocks) and 'ALL BLOCKS RAN' in out, out[-6000:]
