"""The walk a reader takes through the code of one function: every call, in reading order.

Starting at a root function (by default the commit_checkpoint op's CPU kernel), the reader reads
its body top to bottom and, at each call of a function defined in the repository, goes to that
function's body, reads it the same way, and comes back. A function already read is not read
again (a later call of it moves nobody). The calls come from clang's AST, not from text:
`clang++ -Xclang -ast-dump=json` over every translation unit that may define a callee, calls
resolved to their declarations (overloads, members, constructors, template instances), and a
declaration linked to its definition across units by the place it is first declared. Calls of
the standard library, torch and other code outside the repository are not followed; a lambda's
body is read where it is written; destructors and calls through function pointers or
`std::function` are not seen. The functions of format/core/ (the format's vocabulary: names,
paths, shapes, dtypes, checksums, JSON, POSIX file helpers) and of its headers are leaves: the
walk calls them without entering them, as a reader who knows what `join_path` does (--leaves
names other leaves; `--leaves` alone enters every function).

What it prints: the stays (a stay is the trace's time in one file: it begins when the trace
moves into the file, by a call or by a return from a callee, and lasts until it moves out), each
with the functions read or returned to in it; then, per file, how many times the trace entered
it (by a call or a return; the root file's first stay is no entry); then the totals: stays,
returns (stays begun by a return), and the largest number of entries of one file. With
--max-entries N it exits 1 when a file is entered more than N times.

    python3 scripts/call_walk.py                      # the commit_checkpoint walk
    python3 scripts/call_walk.py --quiet --max-entries 4
    python3 scripts/call_walk.py --root FILE:QUALIFIED::NAME --sources 'format/**/*.cpp' ...

Flags for each unit come from a compile_commands.json when one names it (--compdb, a build
folder or the file; default: build/, then build-format/), else from defaults; a unit
under ops/ needs torch's headers, found through the project's Python (FSDP_EMA_PYTHON, as
scripts/env.sh sets it) or --torch-include. Needs clang++ (14 or later); outside CI.
"""
import argparse
import glob
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ROOT = "ops/save/commit_checkpoint.cpp:fsdp_ema::ops::commit_checkpoint"
DEFAULT_SOURCES = ["format/**/*.cpp", "ops/common/*.cpp"]
DEFAULT_LEAVES = ["format/core/*.cpp"]
FUNCTION_KINDS = {"FunctionDecl", "CXXMethodDecl", "CXXConstructorDecl", "CXXConversionDecl"}
CALL_KINDS = {"CallExpr", "CXXMemberCallExpr", "CXXOperatorCallExpr"}
CONSTRUCT_KINDS = {"CXXConstructExpr", "CXXTemporaryObjectExpr"}


def repo_path(path):
    """The repository-relative path of `path`, or None outside the repository."""
    full = os.path.normpath(os.path.join(ROOT, path))
    rel = os.path.relpath(full, ROOT)
    return None if rel.startswith("..") else rel


def torch_includes(python):
    code = ("import torch.utils.cpp_extension as e; "
            "print('\\n'.join(e.include_paths()))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return []
    return out.stdout.split()


def compile_flags(unit, compdb, torch_dirs):
    """The flags clang parses `unit` with: its compile command's -I/-D/-std, or the defaults."""
    entry = compdb.get(os.path.join(ROOT, unit))
    if entry is not None:
        args = entry.get("arguments") or shlex.split(entry["command"])
        keep, skip = [], False
        for a in args[1:]:
            if skip:
                keep.append(a)
                skip = False
            elif a in ("-I", "-isystem", "-D", "-include"):
                keep.append(a)
                skip = True
            elif a.startswith(("-I", "-D", "-std=", "-isystem")):
                keep.append(a)
        return entry["directory"], keep
    flags = ["-std=c++20", "-I" + ROOT, "-I" + os.path.join(ROOT, "include"),
             "-I" + os.path.join(ROOT, "format/include")]
    if unit.startswith(("ops/", "registration/", "kernels/")):
        for d in torch_dirs:
            flags += ["-isystem", d]
    return ROOT, flags


def dump_unit(unit, compdb, torch_dirs):
    """The AST of our namespace in `unit`: a list of JSON objects (clang prints one per match)."""
    directory, flags = compile_flags(unit, compdb, torch_dirs)
    cmd = ["clang++", "-fsyntax-only", "-Wno-everything", *flags, "-Xclang", "-ast-dump=json",
           "-Xclang", "-ast-dump-filter=fsdp_ema", os.path.join(ROOT, unit)]
    out = subprocess.run(cmd, cwd=directory, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"call_walk: clang++ cannot parse {unit}:\n{out.stderr[-3000:]}")
    objs, dec, i, text = [], json.JSONDecoder(), 0, out.stdout
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return directory, objs
        obj, i = dec.raw_decode(text, i)
        objs.append(obj)


class Unit:
    """One translation unit's declarations: id -> (key, name, file) and the bodies it defines."""

    def __init__(self, name, directory):
        self.name, self.directory = name, directory
        self.decls = {}  # id -> dict(qualname, place: (file, offset), previous, type, ...)
        self.records = {}  # qualified class name -> [constructor ids]
        self.bodies = []  # (decl id, body nodes)
        self._file = None

    def path_of(self, file):
        return repo_path(os.path.join(self.directory, file)) if file else None

    def _see_loc(self, loc):
        """Follows clang's elision: a location names its file only when it changes."""
        if not isinstance(loc, dict):
            return None
        if "spellingLoc" in loc or "expansionLoc" in loc:
            self._see_loc(loc.get("spellingLoc"))
            return self._see_loc(loc.get("expansionLoc"))
        if "file" in loc:
            self._file = loc["file"]
        return (self._file, loc.get("offset"))

    def _walk_locs(self, node):
        """Every location below `node`, in print order (keeps the current file right)."""
        if isinstance(node, dict):
            if "offset" in node and ("col" in node or "file" in node):
                self._see_loc(node)
                return
            for k, v in node.items():
                if k == "includedFrom":
                    continue
                self._walk_locs(v)
        elif isinstance(node, list):
            for v in node:
                self._walk_locs(v)

    def read(self, objs):
        for obj in objs:
            self._file = None
            self._node(obj, [])

    def _node(self, node, scope):
        kind = node.get("kind", "")
        place = self._see_loc(node.get("loc")) if "loc" in node else None
        for k, v in node.items():
            if k in ("loc", "inner", "includedFrom"):
                continue
            self._walk_locs(v)
        name = node.get("name")
        inner_scope = scope
        if kind == "NamespaceDecl":
            inner_scope = scope + [name or "(anonymous)"]
        elif kind in ("CXXRecordDecl", "ClassTemplateDecl") and name:
            inner_scope = scope + [name]
        if kind in FUNCTION_KINDS and place is not None:
            qual = "::".join(scope + [name or "?"])
            self.decls[node["id"]] = {
                "kind": kind, "qualname": qual, "place": place, "name": name,
                "previous": node.get("previousDecl"), "implicit": node.get("isImplicit", False),
                "lambda": name == "operator()" and bool(scope) and scope[-1] == "",
                # Compiler-made or `= default`: no body a reader reads.
                "generated": node.get("isImplicit", False) or "explicitlyDefaulted" in node,
                "type": node.get("type", {}).get("qualType", ""),
            }
            if kind == "CXXConstructorDecl" and not node.get("isImplicit"):
                self.records.setdefault("::".join(scope), []).append(node["id"])
            body = [c for c in node.get("inner", []) if c.get("kind") in
                    ("CompoundStmt", "CXXCtorInitializer", "CXXTryStmt")]
            if body:
                self.bodies.append((node["id"], body))
        if kind == "CXXRecordDecl" and not name and node.get("tagUsed") == "class":
            inner_scope = scope + [""]  # a lambda's closure type
        for child in node.get("inner", []):
            if kind == "LambdaExpr" and child.get("kind") == "CXXRecordDecl":
                self._walk_locs(child)  # its body is read where it is written (CompoundStmt)
                continue
            if isinstance(child, dict) and "kind" in child:
                self._node(child, inner_scope)
            else:
                self._walk_locs(child)

    def first(self, decl_id):
        """The first declaration of a function (an out-of-line member's names its class)."""
        seen = set()
        while decl_id in self.decls and self.decls[decl_id]["previous"] in self.decls:
            if decl_id in seen:
                break
            seen.add(decl_id)
            decl_id = self.decls[decl_id]["previous"]
        return self.decls.get(decl_id)

    def key(self, decl_id):
        """Where a function is first declared (file, offset): the same in every unit."""
        d = self.first(decl_id)
        if d is None:
            return None
        file, offset = d["place"]
        path = self.path_of(file)
        return (path, offset) if path else None


def calls_in(unit, body):
    """The declarations `body` calls (ids), in reading order: a call where its text starts."""
    out = []

    def callee(node):
        while node is not None:
            if "referencedDecl" in node:
                return node["referencedDecl"].get("id")
            if "referencedMemberDecl" in node:
                return node["referencedMemberDecl"]
            inner = node.get("inner") or []
            node = inner[0] if inner else None
        return None

    def constructor(node):
        cls = re.sub(r"^(const |volatile )+", "", node.get("type", {}).get("qualType", ""))
        ids = unit.records.get(cls, [])
        want = node.get("ctorType", {}).get("qualType", "")
        nparams = count_params(want)
        fits = [i for i in ids if count_params(unit.decls[i]["type"]) == nparams]
        if len(fits) > 1:
            fits = [i for i in fits if strip_qual(unit.decls[i]["type"]) == strip_qual(want)]
        return fits[0] if len(fits) == 1 else None

    def visit(node):
        if not isinstance(node, dict):
            return
        kind = node.get("kind")
        if kind in CALL_KINDS:
            target = callee(node["inner"][0]) if node.get("inner") else None
            if target is not None:
                out.append(target)
        elif kind in CONSTRUCT_KINDS:
            target = constructor(node)
            if target is not None:
                out.append(target)
        for child in node.get("inner", []):
            if kind == "LambdaExpr" and child.get("kind") == "CXXRecordDecl":
                continue
            visit(child)

    for b in body:
        visit(b)
    return out


def count_params(fn_type):
    m = re.search(r"\((.*)\)", fn_type)
    if not m or not m.group(1).strip() or m.group(1).strip() == "void":
        return 0
    depth, n = 0, 1
    for ch in m.group(1):
        depth += ch in "<([{"
        depth -= ch in ">)]}"
        n += ch == "," and depth == 0
    return n


def strip_qual(text):
    return re.sub(r"\b\w+::", "", text).replace(" ", "")


def summarize(unit):
    """A unit's definitions: [key, qualified name, file, [[callee key, callee name], ...]]."""
    out = []
    for decl_id, body in unit.bodies:
        d = unit.decls[decl_id]
        key = unit.key(decl_id)
        if key is None or d["lambda"] or d["implicit"]:
            continue
        calls = []
        for c in calls_in(unit, body):
            if c in unit.decls and not unit.decls[c]["lambda"] and not unit.decls[c]["generated"]:
                k = unit.key(c)
                if k is not None:
                    calls.append([list(k), unit.first(c)["qualname"]])
        out.append([list(key), unit.first(decl_id)["qualname"], unit.path_of(d["place"][0]),
                    calls])
    return out


class Program:
    """Every definition of the parsed units by key, with the calls of its body."""

    def __init__(self, summaries):
        self.defs = {}  # key -> dict(name, file, calls: [(key, name)])
        for summary in summaries:
            for key, name, file, calls in summary:
                key = tuple(key)
                calls = [(tuple(k), n) for k, n in calls]
                old = self.defs.get(key)
                # Template instances share the pattern's place; their calls are resolved.
                if old is None or len(calls) > len(old["calls"]):
                    self.defs[key] = {"name": name, "file": file, "calls": calls}

    def find(self, file, qualname):
        hits = [k for k, d in self.defs.items() if d["name"] == qualname and d["file"] == file]
        if len(hits) != 1:
            sys.exit(f"call_walk: {len(hits)} definitions of {qualname} in {file}")
        return hits[0]


def leaf_test(globs):
    """Whether a file's functions are leaves: it matches a glob, or it is the header of a source
    that does (format/include/fsdp_ema/format/paths.h for format/core/paths.cpp)."""
    sources = {u for g in globs for u in glob.glob(g, recursive=True)}
    stems = {os.path.splitext(os.path.basename(u))[0] for u in sources if u.endswith(".cpp")}

    def is_leaf(path):
        if path in sources:
            return True
        stem, ext = os.path.splitext(os.path.basename(path))
        return ext == ".h" and stem in stems
    return is_leaf


def walk(program, root, is_leaf, every=False):
    """The stays of the trace, in order: dict(file, how, functions); how = start/call/return."""
    read, steps, unresolved, leaves, active = set(), [], set(), set(), {root}

    def enter(key, how):
        d = program.defs[key]
        steps.append((d["file"], d["name"], how))
        read.add(key)
        for callee, name in d["calls"]:
            if callee not in program.defs:
                unresolved.add(name)
            elif is_leaf(program.defs[callee]["file"]):
                leaves.add(program.defs[callee]["file"])
            elif callee not in read or (every and callee not in active):
                active.add(callee)
                enter(callee, "call")
                active.discard(callee)
                steps.append((d["file"], d["name"], "return"))

    enter(root, "start")
    stays = []
    for file, name, how in steps:
        if stays and stays[-1]["file"] == file:
            if name not in stays[-1]["functions"]:
                stays[-1]["functions"].append(name)
            continue
        stays.append({"file": file, "how": how, "functions": [name]})
    return stays, sorted(unresolved), sorted(leaves)


def load_compdb(paths):
    """Compile commands by absolute source path, from the first file that names a unit."""
    db = {}
    for p in paths:
        f = os.path.join(p, "compile_commands.json") if os.path.isdir(p) else p
        if os.path.isfile(f):
            with open(f, encoding="utf-8") as fh:
                for e in json.load(fh):
                    full = os.path.normpath(os.path.join(e["directory"], e["file"]))
                    db.setdefault(full, e)
    return db


def cached_summary(unit, compdb, torch_dirs, cache, headers):
    """summarize(unit), reused while the unit, the repository's headers, its flags and clang are
    the same (--cache; parsing a unit takes seconds, one with torch's headers ten or more)."""
    directory, flags = compile_flags(unit, compdb, torch_dirs)
    clang = subprocess.run(["clang++", "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256(json.dumps([unit, flags, clang]).encode())
    for f in [unit] + headers:
        with open(f, "rb") as fh:
            h.update(f.encode() + b"\0" + fh.read())
    path = os.path.join(cache, h.hexdigest() + ".json") if cache else None
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    directory, objs = dump_unit(unit, compdb, torch_dirs)
    u = Unit(unit, directory)
    u.read(objs)
    summary = summarize(u)
    if path:
        os.makedirs(cache, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(summary, fh)
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=DEFAULT_ROOT, help="FILE:QUALIFIED::NAME of the start")
    ap.add_argument("--sources", nargs="+", default=DEFAULT_SOURCES,
                    help="globs of the units that may define callees (the root's is added)")
    ap.add_argument("--leaves", nargs="*", default=DEFAULT_LEAVES,
                    help="globs of sources whose functions (and their headers') the walk calls "
                         "without entering them; none: enter everything")
    ap.add_argument("--compdb", nargs="*", default=["build", "build-format"],
                    help="build folders (or compile_commands.json files) to take flags from")
    ap.add_argument("--torch-include", nargs="*", default=None)
    ap.add_argument("--cache", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fsdp_ema_call_walk"),
        help="folder for the per-unit summaries ('' for none)")
    ap.add_argument("--every", action="store_true",
                    help="follow every call, also of a function already read")
    ap.add_argument("--max-entries", type=int, default=None)
    ap.add_argument("--quiet", action="store_true", help="no list of stays")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    root_file, root_name = args.root.split(":", 1)
    units = sorted({u for g in args.sources for u in glob.glob(g, recursive=True)} | {root_file})
    units = [u for u in units if not os.path.basename(u).startswith("xxh3_")]
    headers = sorted(h for top in ("format", "ops", "include")
                     for h in glob.glob(top + "/**/*.h", recursive=True))
    python = os.environ.get("FSDP_EMA_PYTHON", "/opt/fsdp_ema/venv/bin/python")
    torch_dirs = args.torch_include
    if torch_dirs is None:
        torch_dirs = torch_includes(python) if os.path.exists(python) else []
    compdb = load_compdb(args.compdb)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        summaries = list(pool.map(
            lambda u: cached_summary(u, compdb, torch_dirs, args.cache, headers), units))
    program = Program(summaries)
    stays, unresolved, leaves = walk(program, program.find(root_file, root_name),
                                     leaf_test(args.leaves), args.every)

    entries = {}
    for i, s in enumerate(stays):
        if i > 0:
            entries[s["file"]] = entries.get(s["file"], 0) + 1
    returns = sum(s["how"] == "return" for s in stays)
    if not args.quiet:
        print(f"walk of {root_name} ({root_file}): stays in order")
        for i, s in enumerate(stays, 1):
            print(f"{i:4} {s['how']:>6}  {s['file']}: {', '.join(s['functions'])}")
        print()
    if leaves:
        print("called, not entered (--leaves): " + ", ".join(leaves))
    print("entries per file (by a call or a return):")
    for f, n in sorted(entries.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:4}  {f}")
    worst = max(entries.values(), default=0)
    print(f"stays: {len(stays)}, returns: {returns}, calls into another file: "
          f"{len(stays) - 1 - returns}, most entries of one file: {worst}")
    if unresolved:
        print("called but defined in no parsed unit: " + ", ".join(unresolved))
    if args.max_entries is not None and worst > args.max_entries:
        print(f"call_walk: a file is entered {worst} times (more than {args.max_entries})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
