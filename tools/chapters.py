"""The chapter table of the README ('What is here'): one row per notebook under nbs/, in chapter order, with the
subpackage folder, the modules it exports to and the first sentence of its summary line. `python tools/chapters.py`
prints it; `--write` puts it into README.md between the table's header and the blank line after it (then run
tools/sync_index.py); tests/test_house.py checks the README's table against it."""
import json, re, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = '| chapter | module | what it covers |'

def chapters() -> list:
    "`(path, modules, summary)` for every chapter notebook, in chapter-number order."
    out = []
    for nb in (ROOT / 'nbs').rglob('*.ipynb'):
        if nb.name == 'index.ipynb' or any(p.startswith(('_', '.')) for p in nb.relative_to(ROOT).parts): continue
        cells = json.loads(nb.read_text())['cells']
        mods = []
        for c in cells:
            s = ''.join(c['source'])
            for m in re.findall(r'^#\| (?:default_exp|export) +([\w.]+)', s, re.M):
                if m not in mods: mods.append(m)
        head = ''.join(cells[0]['source'])
        m = re.search(r'^> (.*(?:\n> .*)*)', head, re.M)
        summary = ' '.join(l.removeprefix('> ') for l in m.group(1).splitlines()) if m else ''
        first = re.match(r'(.+?[.!?;:])(\s|$)', summary)
        key = re.match(r'(\d+)([a-z]?)', nb.name)
        out.append(((int(key.group(1)), key.group(2)), nb.relative_to(ROOT / 'nbs').with_suffix('').as_posix(),
                    mods, (first.group(1) if first else summary).rstrip(':;')))
    return [o[1:] for o in sorted(out)]

def table() -> str:
    "The README's chapter table."
    rows = [HEADER, '|---|---|---|']
    rows += [f"| `{p}` | {', '.join(f'`{m}`' for m in mods) or '(prose only)'} | {s} |" for p, mods, s in chapters()]
    return '\n'.join(rows) + '\n'

def readme_table(text) -> str:
    "The chapter table as the README has it."
    i = text.index(HEADER)
    return text[i:text.index('\n\n', i) + 1]

if __name__ == '__main__':
    if '--write' in sys.argv:
        p = ROOT / 'README.md'; t = p.read_text()
        p.write_text(t.replace(readme_table(t), table())); print('wrote the chapter table of README.md')
    else: print(table(), end='')
