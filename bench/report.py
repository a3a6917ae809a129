"""Shared tail of the benchmarks: the PASS/MISS list of targets and the optional JSON dump."""

from __future__ import annotations

import json
from pathlib import Path


def finish(results: dict, checks: list, json_path: Path | None) -> None:
    """Prints every (name, ok, detail) check; writes results and checks to json_path if given."""
    print("\ntargets:")
    for name, ok, detail in checks:
        print(f"  [{'PASS' if ok else 'MISS'}] {name}: {detail}")
    if json_path:
        json_path.write_text(json.dumps({"results": results, "checks": checks}, indent=2))
