"""summary.md from the forward tables of the code before (forward-bf16-before.md) and after (forward-bf16.md):
python benchmarks/bench-bf16-keys-2026-12-01/summary.py"""

import re
from pathlib import Path

HERE = Path(__file__).parent


def cells(name: str) -> dict[str, list[tuple[float, float]]]:
    """PE -> [(ms, MB) per length] of a bench report's forward table."""
    rows = {}
    for line in (HERE / name).read_text().splitlines():
        found = re.findall(r"([\d.]+) ms / ([\d.]+) MB", line)
        if line.startswith("| ") and found:
            rows[line.split("|")[1].strip()] = [(float(ms), float(mb)) for ms, mb in found]
    return rows


before, after = cells("forward-bf16-before.md"), cells("forward-bf16.md")
lines = [
    "| PE | 8192 before | 8192 after | 16384 before | 16384 after |",
    "|---|---:|---:|---:|---:|",
]
for pe in before:
    pairs = [(before[pe][i], after[pe][i]) for i in (2, 3)]
    lines.append(
        f"| {pe} | " + " | ".join(f"{mb:,.0f} MB / {ms / 1000:.1f} s" for pair in pairs for ms, mb in pair) + " |"
    )
(HERE / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
