"""The Mermaid renderer the site ships with, so its diagrams draw with no network.

mkdocs-material draws ``mermaid`` fences in the browser and, unless a global ``mermaid``
already exists, loads it from a CDN at page load: offline (an air-gapped cluster, a site
served from an internal host) the pages then show the diagrams' source text. The site
instead loads ``docs/assets/mermaid/mermaid.min.js`` (``extra_javascript`` in mkdocs.yml),
committed here with its MIT licence, taken unchanged from the npm package below. Committed
rather than fetched at build time so that ``mkdocs build`` needs no Node.js and no
registry: the docs build and draw on a host with no network at all.

Usage::

    python docs/vendor_mermaid.py            # verify the committed copy (sha256, licence)
    python docs/vendor_mermaid.py --update   # re-take it with `npm pack mermaid@VERSION`

To move to another version, change ``VERSION``, run ``--update``, put the printed sha256 in
``SHA256`` and check the pages in a browser (tests/test_docs_browser.py does).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

#: The npm package version (mkdocs-material 9.x drives Mermaid 11).
VERSION = "11.17.2"
#: sha256 of ``package/dist/mermaid.min.js`` in ``mermaid-VERSION.tgz`` from the npm registry.
SHA256 = "581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8"

HERE = Path(__file__).resolve().parent / "assets" / "mermaid"
SCRIPT = HERE / "mermaid.min.js"
LICENSE = HERE / "LICENSE"


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check() -> list[str]:
    """What is wrong with the committed copy (empty when it is the pinned one)."""
    problems = []
    if not SCRIPT.exists():
        problems.append(f"{SCRIPT} missing")
    elif sha256(SCRIPT) != SHA256:
        problems.append(f"{SCRIPT} is not mermaid {VERSION} (sha256 {sha256(SCRIPT)})")
    if not LICENSE.exists() or "MIT License" not in LICENSE.read_text(encoding="utf-8"):
        problems.append(f"{LICENSE} missing or not Mermaid's MIT licence")
    return problems


def update() -> str:
    """Take dist/mermaid.min.js and LICENSE from ``npm pack mermaid@VERSION``; return the sha256."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", f"mermaid@{VERSION}", "--silent"], cwd=tmp, check=True,
                       stdout=subprocess.DEVNULL)
        with tarfile.open(Path(tmp) / f"mermaid-{VERSION}.tgz") as tar:
            for member, dest in (("package/dist/mermaid.min.js", SCRIPT), ("package/LICENSE", LICENSE)):
                src = tar.extractfile(member)
                assert src is not None, member
                HERE.mkdir(parents=True, exist_ok=True)
                with src, dest.open("wb") as out:
                    shutil.copyfileobj(src, out)
    return sha256(SCRIPT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="re-take the files from npm")
    args = parser.parse_args(argv)
    if args.update:
        print(f"mermaid {VERSION}: sha256 {update()}")
    problems = check()
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
