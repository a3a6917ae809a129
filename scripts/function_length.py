"""Fails when a Python function of the tree is longer than a reader can hold: more than LIMIT
lines, its docstring not counted (a long docstring is documentation, not code to hold), unless
ALLOWED names it with the reason it stays whole. Every tracked Python file counts: the library,
its tests, benchmarks, examples and scripts. Run by scripts/lint.sh.

    python scripts/function_length.py            # check
    python scripts/function_length.py --report   # every function over LIMIT / 2, longest first
"""
import ast
import subprocess
import sys

LIMIT = 80

# "path:qualified name": why it stays one function. A function here may not grow past its
# length when it was allowed plus a few lines (ALLOWED_SLACK), so an entry is no blank cheque.
ALLOWED = {
    "examples/train.py:main": (
        202, "the demo's whole training run (scripts/demo.sh), read top to bottom as a script; "
             "the docs quote it"),
    "bench/bench_host_ema.py:worker": (
        123, "one measured process: setup, the timed loops of every method and the printed row "
             "in one frame, so that the timings see the same locals and no call boundaries"),
    "bench/bench_async.py:worker": (
        116, "one measured process (as bench_host_ema.worker)"),
    "bench/bench_teacher.py:rank_main": (
        93, "one measured rank (as bench_host_ema.worker)"),
    "bench/bench_checkpoint.py:run_place": (
        90, "one measured process (as bench_host_ema.worker)"),
    "python_tests/test_teacher.py:run_gradients_reshard_compile_lora": (
        124, "one spawned rank's sequence of checks sharing one process group and one compiled "
             "teacher: split, each part would pay the group and the compile again"),
    "python_tests/test_reliability.py:test_sigkill_during_multi_file_save": (
        91, "one kill scenario: the child's script, the kill and every check of what it left, "
            "which only make sense together"),
}
ALLOWED_SLACK = 5


def length(node: ast.AST) -> int:
    """Lines of a function, its docstring not counted."""
    n = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        n -= first.end_lineno - first.lineno + 1
    return n


def functions(path: str):
    """``(qualified name, line, length)`` of every function and method in ``path``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield name, child.lineno, length(child)
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def main(argv):
    files = subprocess.run(["git", "ls-files", "*.py"], check=True, capture_output=True,
                           text=True).stdout.split()
    found = [(n, f"{path}:{name}", line) for path in files
             for name, line, n in functions(path)]
    if "--report" in argv:
        for n, key, line in sorted(found, reverse=True):
            if n > LIMIT // 2:
                print(f"{n:5d}  {key} (line {line})")
        return 0
    problems = 0
    for n, key, line in found:
        allowed = ALLOWED.get(key)
        limit = LIMIT if allowed is None else max(LIMIT, allowed[0] + ALLOWED_SLACK)
        if n > limit:
            path = key.split(":")[0]
            why = ("" if allowed is None else
                   f" (allowed {allowed[0]} lines: {allowed[1]}; split it, or restate the reason)")
            print(f"{path}:{line}: {key.split(':', 1)[1]} is {n} lines, docstring aside; the "
                  f"limit is {limit}{why}", file=sys.stderr)
            problems += 1
    lengths = {key: n for n, key, _ in found}
    for key in sorted(ALLOWED):
        if lengths.get(key, 0) <= LIMIT:
            state = "no longer exists" if key not in lengths else f"is {lengths[key]} lines now"
            print(f"scripts/function_length.py: ALLOWED names {key}, which {state}: remove the "
                  f"entry", file=sys.stderr)
            problems += 1
    if problems:
        print(f"function_length: {problems} function(s) over {LIMIT} lines without a stated "
              f"reason (split them by what they do, or add a reason to ALLOWED)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
