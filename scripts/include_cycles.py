"""Fails when the C++ units include each other in a circle.

A unit is a header and the source of the same name (format/include/fsdp_ema/format/paths.h
and format/core/paths.cpp are the unit format:paths), with its private header `<name>_impl.h`
if it has one (format/dir/checkpoint_dir_impl.h belongs to format:checkpoint_dir); unit A
depends on unit B when A's header or source includes B's header. The floors call down
(registration -> ops -> kernels / format) and, inside a floor, the units form no cycle: a reader
can start from the bottom and never meet a unit that needs one not read yet. Prints the units of
every cycle and the includes between them. Run by scripts/lint.sh.
"""
import os
import re
import sys

from lint_common import report, tracked, verdict

SOURCES = (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh")
# Where a quoted include is looked up, as the build's include directories give it.
INCLUDE_ROOTS = ("", "format/include/", "include/")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def unit_of(path):
    """'format:paths' for format/core/paths.cpp and format/include/fsdp_ema/format/paths.h."""
    top = path.split("/", 1)[0]
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{top}:{stem.removesuffix('_impl')}"


def resolve(included, including, in_tree):
    here = os.path.dirname(including)
    for root in (here + "/" if here else "",) + INCLUDE_ROOTS:
        candidate = os.path.normpath(root + included)
        if candidate in in_tree:
            return candidate
    return None  # a system or third-party header


def main():
    files = tracked()
    product = [f for f in files if f.endswith(SOURCES) and not f.startswith(("tests/", "bench/"))]
    in_tree = set(files)
    edges = {}
    for path in product:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        a = unit_of(path)
        edges.setdefault(a, set())
        for included in INCLUDE.findall(text):
            target = resolve(included, path, in_tree)
            if target is None:
                continue
            b = unit_of(target)
            if b != a:
                edges[a].add(b)
    # Tarjan's strongly connected components: every component of more than one unit is a cycle.
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    for component in cycles:
        members = set(component)
        lines = [f"  {a} -> {b}" for a in component for b in sorted(edges[a]) if b in members]
        report("include cycle between " + ", ".join(component) + ":\n" + "\n".join(lines))
    return verdict("include_cycles", len(cycles), f"{len(cycles)} cycle(s) (a unit is a header "
                   "and the source of the same name; move what both need into a unit below them)")


if __name__ == "__main__":
    sys.exit(main())
