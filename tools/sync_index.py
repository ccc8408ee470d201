"""Rebuild nbs/index.ipynb from README.md: one markdown cell per `## ` section (Quarto, which nbdev-readme
needs, cannot be installed here, so the README is the source and the index follows it). Run nbdev-clean after."""
import hashlib, json, re
from pathlib import Path

root = Path(__file__).resolve().parent.parent
readme, index = (root/'README.md').read_text(), root/'nbs'/'index.ipynb'
nb = json.loads(index.read_text())
parts = re.split(r'(?m)^(?=## )', readme.strip('\n'))
nb['cells'] = [{"cell_type": "markdown", "id": hashlib.sha1(f"index{i}".encode()).hexdigest()[:8], "metadata": {},
                "source": p.strip('\n').splitlines(keepends=True)} for i, p in enumerate(parts)]
index.write_text(json.dumps(nb, indent=1))
