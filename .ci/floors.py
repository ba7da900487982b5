#!/usr/bin/env python3
"""The floors check: no top-level module of src/ imports one that imports it back.

Reads every `crate::` path written in src/**/*.rs: in `use` items (grouped ones such as
`use crate::{a, b::c}` included), in `pub use` re-exports, in code (`crate::service::Chain(..)`),
in macros (`$crate::`), and `super::` paths that climb to the crate root. A file belongs to its
top-level module: src/foo.rs and everything under src/foo/ are `foo`. src/lib.rs is the root: it
declares and re-exports everything, so it is not an importer; its re-exports are read only to
resolve a path such as `crate::RecoveryPoint` to the module that defines the name (`recovery`).

What is not an import here:
- comments, doc comments included: an intra-doc link such as [`crate::layer`] documents a name,
  the code does not depend on it;
- string and character literals;
- `#[cfg(test)]` modules (`mod tests { .. }` inline, or `mod tests;` and its files). A unit test
  module is a leaf that nothing imports, and a test of a lower floor may drive it through a
  higher one. Any other test-only item (a `#[cfg(test)] use` or fn in the module itself) is
  part of the module and counts. `--tests` counts the test modules too.

The graph of top-level modules must have no cycle: a strongly connected component of more than
one module is printed with each edge inside it and the file:line of every path that makes that
edge. The floors follow, ground first: a module stands one floor above the highest it imports
(a cycle, while there is one, is drawn as one room).

One floor is also held by name: the store contract and the stores (src/store/) import no other
top-level module, except those in STORE_MAY_IMPORT (bottom helpers that import nothing back; none
today).

Exit status: 0 when there is no cycle and the store imports nothing above it; 1 otherwise.
Standard library only. Run from anywhere: `python3 .ci/floors.py [--tests]`.
"""

import os
import re
import sys
from collections import defaultdict

# Top-level modules that src/store/ may import: bottom helpers that import nothing back.
STORE_MAY_IMPORT = set()

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SRC = os.path.join(ROOT, "src")

TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<line_comment>//[^\n]*)
  | (?P<block_comment>/\*)
  | (?P<raw_string>b?r(?P<hashes>\#*)")
  | (?P<string>b?")
  | (?P<char>b?'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\}|.)|[^\\'\n])')
  | (?P<lifetime>'[A-Za-z_][A-Za-z0-9_]*)
  | (?P<ident>\$?[A-Za-z_][A-Za-z0-9_]*)
  | (?P<path_sep>::)
  | (?P<punct>.)
    """,
    re.VERBOSE | re.DOTALL,
)


def tokens(text):
    """Yields (kind, value, line) for identifiers, `::` and punctuation; drops the rest."""
    pos, line, end = 0, 1, len(text)
    while pos < end:
        m = TOKEN.match(text, pos)
        kind = m.lastgroup if m.lastgroup != "hashes" else "raw_string"
        if m.group("raw_string") is not None:
            kind = "raw_string"
        start = pos
        if kind == "block_comment":
            depth, pos = 1, m.end()
            while depth and pos < end:
                if text.startswith("/*", pos):
                    depth, pos = depth + 1, pos + 2
                elif text.startswith("*/", pos):
                    depth, pos = depth - 1, pos + 2
                else:
                    pos += 1
        elif kind == "raw_string":
            close = '"' + m.group("hashes")
            found = text.find(close, m.end())
            pos = end if found < 0 else found + len(close)
        elif kind == "string":
            pos = m.end()
            while pos < end and text[pos] != '"':
                pos += 2 if text[pos] == "\\" else 1
            pos += 1
        else:
            pos = m.end()
            if kind in ("ident", "path_sep", "punct"):
                yield kind, m.group(kind), line
        line += text.count("\n", start, pos)


def use_tree(toks, i):
    """Parses a path or use tree at toks[i]; returns ([(segments, line)], next index)."""
    paths = []

    def tree(i, prefix):
        segs = list(prefix)
        while i < len(toks):
            kind, value, line = toks[i]
            if kind == "ident":
                segs.append((value, line))
                i += 1
                if i < len(toks) and toks[i][0] == "path_sep":
                    i += 1
                    continue
                if i + 1 < len(toks) and toks[i][1] == "as":
                    i += 2
                paths.append(segs)
                return i
            if value == "{":
                i += 1
                while i < len(toks) and toks[i][1] != "}":
                    if toks[i][1] == ",":
                        i += 1
                        continue
                    i = tree(i, segs)
                return i + 1
            if value == "*":
                paths.append(segs + [("*", line)])
                return i + 1
            break
        if segs:
            paths.append(segs)
        return i

    return paths, tree(i, [])


def module_path(path):
    """src/foo/bar.rs and src/foo/bar/mod.rs are ["foo", "bar"]; src/lib.rs is []."""
    rel = os.path.relpath(path, SRC).replace(os.sep, "/")[: -len(".rs")]
    parts = rel.split("/")
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return parts


def scan(path, count_tests):
    """Yields (segments after the crate root, line) for every path that reaches the root,
    and the names of `#[cfg(test)] mod NAME;` declared out of line, as ("test_mod", name)."""
    with open(path, encoding="utf-8") as f:
        toks = list(tokens(f.read()))
    here = module_path(path)
    inline = []  # (name, brace depth at which it opened)
    depth = 0
    pending_test = False
    skip_until = None  # brace depth that ends a skipped test module
    i = 0
    while i < len(toks):
        kind, value, line = toks[i]
        if value == "{":
            depth += 1
        elif value == "}":
            depth -= 1
            if skip_until is not None and depth == skip_until:
                skip_until = None
            while inline and inline[-1][1] == depth:
                inline.pop()
        if skip_until is not None:
            i += 1
            continue
        if value == "#" and i + 6 < len(toks) and [t[1] for t in toks[i + 1 : i + 7]] == [
            "[", "cfg", "(", "test", ")", "]",
        ]:
            pending_test = True
            i += 7
            continue
        if kind == "ident" and value == "mod" and i + 2 < len(toks) and toks[i + 1][0] == "ident":
            name, after = toks[i + 1][1], toks[i + 2][1]
            if pending_test and not count_tests:
                if after == ";":
                    yield ("test_mod", here + [t[0] for t in inline] + [name]), line
                elif after == "{":
                    skip_until = depth
                    depth += 1
                i += 3
                pending_test = False
                continue
            if after == "{":
                inline.append((name, depth))
                depth += 1
                i += 3
                pending_test = False
                continue
        if value in (";", "}") or (kind == "ident" and value in ("fn", "use", "struct", "impl")):
            pending_test = False
        starts = kind == "ident" and value in ("crate", "$crate", "super")
        if starts and i + 1 < len(toks) and toks[i + 1][0] == "path_sep":
            prev = toks[i - 1][1] if i else ""
            if prev == "::" and value == "super":  # `self::super::` or the like: rare, skipped
                i += 1
                continue
            paths, i = use_tree(toks, i)
            scope = here + [t[0] for t in inline]
            for segs in paths:
                names = [s for s, _ in segs]
                if names[0] == "super":
                    ups = 0
                    while ups < len(names) and names[ups] == "super":
                        ups += 1
                    if ups < len(scope):
                        continue  # stays inside this top-level module
                    rest = segs[ups:]
                else:
                    rest = segs[1:]
                if rest and rest[0][0] != "self":
                    yield tuple(s for s, _ in rest), rest[0][1]
            continue
        i += 1


def root_names(modules):
    """Maps each name that src/lib.rs re-exports to the top-level module that holds it."""
    names = {}
    with open(os.path.join(SRC, "lib.rs"), encoding="utf-8") as f:
        toks = list(tokens(f.read()))
    depth = 0
    for i, (kind, value, _) in enumerate(toks):
        if value == "{":
            depth += 1
        elif value == "}":
            depth -= 1
        elif depth == 0 and value == "use":
            j = i + 1
            paths, _ = use_tree(toks, j)
            for segs in paths:
                seg = [s for s, _ in segs]
                if seg and seg[0] == "crate":
                    seg = seg[1:]
                if len(seg) >= 2 and seg[0] in modules:
                    names[seg[-1]] = seg[0]
    return names


def strongly_connected(graph, nodes):
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main():
    count_tests = "--tests" in sys.argv[1:]
    files = []
    for d, _, names in os.walk(SRC):
        files += [os.path.join(d, n) for n in names if n.endswith(".rs")]
    files.sort()
    modules = {module_path(f)[0] for f in files if module_path(f)}
    reexports = root_names(modules)

    found = []  # (file, line, top-level module of the file, segments)
    test_mods = set()
    for f in files:
        mp = module_path(f)
        if not mp:
            continue
        for item, line in scan(f, count_tests):
            if item[0] == "test_mod":
                test_mods.add(tuple(item[1]))
            else:
                found.append((f, line, mp[0], item))
    if not count_tests:
        skipped = {
            f for f in files
            if any(tuple(module_path(f)[: len(t)]) == t for t in test_mods)
        }
        found = [x for x in found if x[0] not in skipped]

    edges = defaultdict(list)  # (from, to) -> ["file:line name", ...]
    graph = defaultdict(set)
    for f, line, src, segs in found:
        first = segs[0]
        dst = first if first in modules else reexports.get(first)
        if dst is None or dst == src:
            continue
        where = "%s:%d" % (os.path.relpath(f, ROOT), line)
        edges[(src, dst)].append("%s %s" % (where, "::".join(segs)))
        graph[src].add(dst)
    for m in modules:
        graph[m]

    failed = False
    comps = strongly_connected(graph, modules)
    cycles = [c for c in comps if len(c) > 1]
    for n, comp in enumerate(cycles, 1):
        failed = True
        print("cycle %d: %d modules: %s" % (n, len(comp), ", ".join(comp)))
        for a in comp:
            for b in sorted(graph[a]):
                if b in comp:
                    print("  %s -> %s" % (a, b))
                    for e in edges[(a, b)]:
                        print("      " + e)
        print()

    above = sorted(graph["store"] - STORE_MAY_IMPORT)
    if above:
        failed = True
        print("the store imports modules above it (allowed: %s):"
              % (", ".join(sorted(STORE_MAY_IMPORT)) or "none"))
        for b in above:
            print("  store -> %s" % b)
            for e in edges[("store", b)]:
                print("      " + e)
        print()

    room = {m: i for i, c in enumerate(comps) for m in c}
    floor = {}
    for i, comp in enumerate(comps):  # Tarjan's order: a component after all it reaches
        below = {room[b] for a in comp for b in graph[a]} - {i}
        floor[i] = 1 + max((floor[j] for j in below), default=0)
    print("floors, ground first (a module stands above all it imports):")
    for level in range(1, max(floor.values(), default=0) + 1):
        rooms = [", ".join(c) if len(c) == 1 else "{%s}" % ", ".join(c)
                 for i, c in enumerate(comps) if floor[i] == level]
        print("  %2d  %s" % (level, "; ".join(sorted(rooms))))

    if failed:
        print("\nfailed: the top-level modules must import only downward (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
