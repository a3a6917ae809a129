"""Fails when a module of the Python front reaches into another module's private parts: the
front talks between modules through public names only (docs/ARCHITECTURE.md, "The Python
front"). In python/fsdp_ema it refuses

- an import of a private name (``from ..model.slots import _discover``) from a module of another
  package (the doors ``_ops``, ``_dtypes`` and ``_library`` are modules, not names: importing
  them is how every package reaches the ops);
- a read or write of ``obj._name`` (or ``getattr``/``setattr``/``hasattr``/``delattr`` of it, or
  ``obj.__dict__["_name"]``) where ``obj`` is not ``self``/``cls`` and ``_name`` is a private
  attribute or method that a class of ANOTHER module of the front defines (``ema._ema`` from
  the teacher), or a private module-level name of another module (``_ckpt._gc_paused``); torch's
  own private attributes (``param._local_tensor``) are not ours and are not refused here. A name
  the reading module also defines for itself is taken as its own (the check reads names, not
  types);
- a cache hung on another object through ``__dict__.setdefault`` (state belongs in the object
  that owns it: ``ShardedEMA.state``).

Run by scripts/lint.sh.
"""
import ast
import sys
from pathlib import Path

from lint_common import report, tracked, verdict

FRONT = "python/fsdp_ema/"
DOORS = {"_ops", "_dtypes", "_library"}
# torch's private attributes that one of our modules also names for itself (FSDP1's
# ``module._handle`` and ``flat_param._params``, read in model/slots.py, beside our own
# ``self._handle`` and ``store/binding.py``'s ``_params``).
TORCH_NAMES = {"_handle", "_params"}


def package_of(path: str) -> str:
    """``python/fsdp_ema/ema/state.py`` -> ``fsdp_ema.ema``."""
    return ".".join(Path(path).parent.parts[1:])


def resolve(path: str, node: ast.ImportFrom) -> str:
    pkg = package_of(path).split(".")
    if node.level:
        pkg = pkg[:len(pkg) - (node.level - 1)]
        return ".".join(pkg + ([node.module] if node.module else []))
    return node.module or ""


def private_definitions(tree: ast.AST) -> set[str]:
    """Private attributes and methods the classes of a module define, and its private
    module-level functions, classes and variables."""
    out = set()
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
        else:
            names = []
        out.update(n for n in names if n.startswith("_") and not n.startswith("__"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        item.name.startswith("_") and not item.name.startswith("__"):
                    out.add(item.name)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) and \
                        isinstance(item.value, ast.Name) and item.value.id == "self" and \
                        item.attr.startswith("_") and not item.attr.startswith("__"):
                    out.add(item.attr)
    return out


def is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def literal(node: ast.AST):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def main() -> int:
    files = [f for f in tracked() if f.startswith(FRONT) and f.endswith(".py")]
    trees = {f: ast.parse(Path(f).read_text(), f) for f in files}
    defined = {f: private_definitions(t) for f, t in trees.items()}
    problems = []
    for f, tree in trees.items():
        others = (set().union(*(d for g, d in defined.items() if g != f)) - defined[f]
                  - TORCH_NAMES)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = resolve(f, node)
                for alias in node.names:
                    name = alias.name
                    if (source.startswith("fsdp_ema") and name.startswith("_")
                            and not name.startswith("__") and name not in DOORS
                            and source.rsplit(".", 1)[0] != package_of(f)
                            and source != package_of(f)):
                        problems.append(f"{f}:{node.lineno}: imports the private name {name!r} "
                                        f"from {source} (another package): make it public there")
            elif isinstance(node, ast.Attribute) and node.attr in others:
                if not is_self(node.value):
                    problems.append(f"{f}:{node.lineno}: reads another module's private "
                                    f"attribute {node.attr!r}: use a public name "
                                    f"(ShardedEMA.state)")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                  and len(node.args) >= 2 and literal(node.args[1]) in others
                  and not is_self(node.args[0])):
                problems.append(f"{f}:{node.lineno}: {node.func.id}() of another module's "
                                f"private attribute {literal(node.args[1])!r}")
            elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                  and node.value.attr == "__dict__" and literal(node.slice) in others
                  and not is_self(node.value.value)):
                problems.append(f"{f}:{node.lineno}: __dict__ of another module's private "
                                f"attribute {literal(node.slice)!r}")
            elif (isinstance(node, ast.Attribute) and node.attr == "setdefault"
                  and isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__"):
                problems.append(f"{f}:{node.lineno}: hangs a cache on an object through "
                                f"__dict__.setdefault: keep it in the object's own state")
    for p in problems:
        report(p)
    return verdict("private_access", len(problems),
                   f"{len(problems)} reach(es) into another module's private parts")


if __name__ == "__main__":
    sys.exit(main())
