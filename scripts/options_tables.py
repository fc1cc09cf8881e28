"""Rewrite the option tables in docs/strategy.md and docs/fabric.md from the declarations.

    python scripts/options_tables.py          # rewrite the tables that are stale
    python scripts/options_tables.py --check  # exit 1 if any table is stale (tests/lightning/test_options.py does this)

The tables sit between two HTML comments; everything else on the pages is hand-written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from lightning_ddpx.lightning.settings.options import options_table  # noqa: E402

DOCS_TABLES = {"Trainer": "docs/strategy.md", "Fabric": "docs/fabric.md"}
BEGIN = "<!-- options table: made by `python scripts/options_tables.py` -->"
END = "<!-- end of options table -->"
_TABLE = re.compile(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), re.S)


def stale_pages(write: bool) -> list[str]:
    """Pages whose table differs from the declarations (rewritten when ``write``)."""
    stale = []
    for strategy, page in DOCS_TABLES.items():
        path = REPO_ROOT / page
        text = path.read_text()
        match = _TABLE.search(text)
        if match is None:
            raise SystemExit(f"{page} has no options table between {BEGIN!r} and {END!r}")
        table = options_table(strategy)
        if match.group(1) != table:
            stale.append(page)
            if write:
                path.write_text(text[: match.start(1)] + table + text[match.end(1) :])
    return stale


if __name__ == "__main__":
    check = "--check" in sys.argv[1:]
    pages = stale_pages(write=not check)
    print(("stale: " if check else "rewrote: ") + ", ".join(pages) if pages else "docs tables up to date")
    sys.exit(1 if check and pages else 0)
