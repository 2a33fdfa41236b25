"""Copy benchmark tables from bench/results/*.md into the README between marker comments.

A README section ``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->`` receives results/NAME.md.
Run after the benchmarks: python bench/update_readme.py
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    for name in re.findall(r"<!-- bench:([\w-]+) -->", text):
        table = (RESULTS / f"{name}.md").read_text().strip()
        text = re.sub(rf"(<!-- bench:{name} -->).*?(<!-- /bench:{name} -->)",
                      lambda m: f"{m.group(1)}\n{table}\n{m.group(2)}", text, flags=re.S)
        print(f"updated {name}")
    readme.write_text(text)


if __name__ == "__main__":
    main()
