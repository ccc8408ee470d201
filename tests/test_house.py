"""The house's rules (DESIGN.md, 'The house'), checked on the generated package: each subpackage's `__init__` lists the
public names of its modules, the package's lists the names a user needs and imports nothing heavy, no import cycle,
no `_private` name imported across modules, a chapter imports only earlier chapters, modules and exported cells
within their sizes, lines within 120 characters."""
import ast, json, re, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / 'nanochat_dl'
MODULES = sorted(p for p in LIB.rglob('*.py') if p.name != '_modidx.py' and '__pycache__' not in p.parts)

def mod_name(p) -> str:
    "The dotted name of module file `p`."
    parts = p.relative_to(ROOT).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)

def imports(p) -> list:
    "`(module, [names])` for every `from nanochat_dl... import` in `p` (inside functions too), relative ones resolved."
    me, out = mod_name(p), []
    pkg = me if p.name == '__init__.py' else me.rpartition('.')[0]
    for node in ast.walk(ast.parse(p.read_text())):
        if not isinstance(node, ast.ImportFrom): continue
        if node.level:
            base = pkg.split('.')[:len(pkg.split('.')) - node.level + 1]
            mod = '.'.join(base + ([node.module] if node.module else []))
        else: mod = node.module or ''
        if mod.startswith('nanochat_dl'): out.append((mod, [a.name for a in node.names]))
    return out

def chapter_of(p):
    "The chapter number (e.g. (12, 'a')) a generated module comes from, from nbdev's `# %% ../nbs/...` markers."
    m = re.search(r'^# %% [./]*nbs/(?:\w+/)*(\d+)([a-z]?)_\w+\.ipynb', p.read_text(), re.M)
    return (int(m.group(1)), m.group(2)) if m else None

def test_inits_are_in_step_with_the_modules():
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'make_inits.py'), '--check'], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

def test_the_package_names_what_a_user_needs_and_imports_nothing_heavy():
    code = ("import sys, nanochat_dl as n; assert 'torch' not in sys.modules and 'pyarrow' not in sys.modules, 'heavy'; "
            "from nanochat_dl import PackedLoader, StreamingLoader, StreamingDataset, TokenRoot, Tokenizer, get_tokenizer, "
            "save_loader_states, load_loader_states, download, tokenize; "
            "import nanochat_dl.dataloader as d; assert callable(d.tokenizing_distributed_data_loader_with_state_bos_bestfit); "
            "print(len(n.__all__))")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) >= 10

@pytest.mark.parametrize('sub', ['io', 'text', 'pipe', 'tokens', 'bench'])
def test_each_subpackage_gives_every_public_name_of_its_modules(sub):
    import importlib
    pkg = importlib.import_module(f'nanochat_dl.{sub}')
    for p in sorted((LIB / sub).glob('[!_]*.py')):
        m = importlib.import_module(f'nanochat_dl.{sub}.{p.stem}')
        for name in m.__all__: assert getattr(pkg, name) is getattr(m, name), (sub, p.stem, name)

def test_no_private_name_is_imported_across_modules():
    bad = [f"{mod_name(p)} <- {m}: {n}" for p in MODULES for m, names in imports(p) for n in names
           if n.startswith('_') and not n.startswith('__') and m != mod_name(p)]
    assert not bad, bad

def test_no_import_cycle():
    graph = {mod_name(p): {m for m, _ in imports(p)} for p in MODULES if p.name != '__init__.py'}
    state, cycles = {}, []
    def visit(u, path):
        if state.get(u) == 1: cycles.append(path[path.index(u):] + [u]); return
        if state.get(u) == 2: return
        state[u] = 1
        for v in graph.get(u, ()): visit(v, path + [u])
        state[u] = 2
    for u in graph: visit(u, [])
    assert not cycles, cycles

def test_a_chapter_imports_only_earlier_chapters():
    chap = {mod_name(p): chapter_of(p) for p in MODULES}
    bad = [f"{mod_name(p)} ({chap[mod_name(p)]}) imports {m} ({chap.get(m)})" for p in MODULES for m, _ in imports(p)
           if chap.get(mod_name(p)) and chap.get(m) and chap[m] > chap[mod_name(p)]]
    assert not bad, bad

def test_modules_and_lines_within_their_sizes():
    long_mods = [f"{p.relative_to(ROOT)}: {n}" for p in MODULES if (n := len(p.read_text().splitlines())) > 500]
    long_lines = [f"{p.relative_to(ROOT)}:{i}" for p in MODULES for i, l in enumerate(p.read_text().splitlines(), 1)
                  if len(l) > 120 and not l.startswith('__all__ = ')]   # nbdev wraps its own `__all__` at 120 + 10
    assert not long_mods, long_mods
    assert not long_lines, long_lines[:20]

def test_exported_cells_within_their_size():
    big = []
    for nb in sorted((ROOT / 'nbs').rglob('*.ipynb')):
        for c in json.loads(nb.read_text())['cells']:
            src = ''.join(c['source'])
            if c['cell_type'] == 'code' and src.lstrip().startswith('#| export') and len(src.splitlines()) > 40:
                big.append(f"{nb.relative_to(ROOT)}: {src.splitlines()[1][:60]!r} ({len(src.splitlines())} lines)")
    assert not big, big

def test_the_readme_lists_every_chapter_and_its_modules():
    sys.path.insert(0, str(ROOT / 'tools'))
    import chapters
    assert chapters.readme_table((ROOT / 'README.md').read_text()) == chapters.table(), \
        "README's chapter table is out of step with nbs/: run python tools/chapters.py --write"
