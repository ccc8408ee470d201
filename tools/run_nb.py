"""Execute notebooks in place so their committed outputs (tables, pictures) are real.

Cells flagged with any of `--skip` (default: `notest cuda`) are left unexecuted, exactly as
`nbdev-test` would skip them, and their outputs cleared (kept with `--keep`). Usage: `python tools/run_nb.py nbs/04_packing.ipynb [--skip notest cuda]`.
Run `nbdev-clean` afterwards.
"""
import argparse, sys
from pathlib import Path
from execnb.shell import CaptureShell
from fastcore.nbio import read_nb, write_nb

def _flags(cell):
    flags = set()
    for line in cell.source.splitlines():
        s = line.strip()
        if not s.startswith('#|'): break
        flags.update(s[2:].split())
    return flags

def run(path, skip, keep=False):
    nb = read_nb(path)
    skip = set(skip)
    def pre(cell):
        if cell.cell_type != 'code': return True
        if _flags(cell) & skip:
            if not keep: cell.outputs, cell.execution_count = [], None
            return True
        return False
    shell = CaptureShell(mpl_format='png')
    shell.set_path(Path(path).parent.resolve())
    shell.run_all(nb, exc_stop=True, preproc=pre)
    write_nb(nb, path)

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument('paths', nargs='+')
    p.add_argument('--skip', nargs='*', default=['notest', 'cuda'])
    p.add_argument('--keep', action='store_true', help='leave the outputs of skipped cells as they are (e.g. --skip notest cuda slow --keep)')
    a = p.parse_args()
    for path in a.paths:
        print('executing', path, file=sys.stderr)
        run(path, a.skip, a.keep)
