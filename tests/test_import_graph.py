"""The import graph of the ls_fairseq package, read from the source with ``ast`` (nothing is
imported): no cycle, and no arrow from a lower layer up to a higher one.

Every ``import`` / ``from ... import`` counts, at module level or inside a function (a lazy import
is still a dependency; it only moves the failure to the first call). An edge goes to the module
that is named: ``from .x import f`` -> ``<package>.x``; ``from . import x`` -> ``<package>.x`` when
``x`` is a module, else the package itself (its ``__init__``). The parent packages that Python
imports on the way are not edges (otherwise every module would form a cycle with its package's
``__init__``).

Layers, lowest first (``ls_fairseq/ops/README.md`` for ops' own convention):

* ``ops`` (the fused ops and their bindings) imports nothing from ``modules``, ``models``,
  ``criterions``, ``optim``, ``graphs`` or ``distributed``;
* ``modules`` (the layers) imports nothing from ``models``, ``criterions``, ``optim`` or
  ``distributed``;
* ``distributed`` (the gradient all-reduce, the copy-engine all-reduce, the sharded optimizer
  step, async stats) sits on ``ops``: it imports nothing from ``graphs``, ``criterions``,
  ``optim``, ``models``, ``modules``, ``generation``, ``data`` or ``fairseq_patches``;
* ``graphs`` (CUDA graph capture and replay) may import ``distributed`` (the engine holds its
  gradient reducer) and imports nothing from ``criterions``, ``optim`` or ``models``;
* ``optim`` may import ``distributed`` and the ``graphs`` package's public names (its
  ``__init__``), never a module inside ``graphs`` (``test_optim_uses_no_graphs_internals``);
* ``generation`` (decoding) sits above ``models``: nothing below imports it, and it imports
  nothing from ``criterions``, ``optim`` or ``graphs``;
* ``data`` (the order of an epoch's batches) sits beside ``graphs``' shape policy, whose
  ``shape_buckets`` it uses: it imports nothing from ``modules``, ``models``, ``criterions``,
  ``optim`` or ``generation``, and ``ops``, ``modules``, ``graphs`` and ``generation`` import
  nothing from it;
* ``switches`` (the on/off modes and the refusal error) and ``training_config`` (a run's
  ``--ls-*`` switches, read once) sit below every layer that has a switch: they import none of
  them (``training_config`` imports ``switches`` only);
* ``fairseq_patches`` (every change to fairseq's classes) is the top: no layer imports it, and
  only the package's ``__init__`` (which installs it) does.

Run as a script (``python tests/test_import_graph.py``) it prints the cycles and upward arrows.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ls_fairseq"

#: layer -> the subpackages of ls_fairseq it must not import
FORBIDDEN = {
    "ops": ("modules", "models", "criterions", "optim", "graphs", "distributed", "generation",
            "data", "fairseq_patches"),
    "modules": ("models", "criterions", "optim", "distributed", "generation", "data",
                "fairseq_patches"),
    "distributed": ("graphs", "criterions", "optim", "models", "modules", "generation", "data",
                    "fairseq_patches"),
    "models": ("generation", "fairseq_patches"),
    "criterions": ("fairseq_patches",),
    "optim": ("fairseq_patches",),
    "graphs": ("criterions", "optim", "models", "generation", "data", "fairseq_patches"),
    "generation": ("criterions", "optim", "graphs", "distributed", "data", "fairseq_patches"),
    "data": ("modules", "models", "criterions", "optim", "distributed", "generation",
             "fairseq_patches"),
    # a run's --ls-* switches: read by every layer that has a switch, so it imports none of them
    "training_config": ("ops", "modules", "models", "criterions", "optim", "graphs",
                        "distributed", "generation", "data", "fairseq_patches"),
    "switches": ("ops", "modules", "models", "criterions", "optim", "graphs", "distributed",
                 "generation", "data", "fairseq_patches", "training_config"),
}
#: the one module outside fairseq_patches that may import it: the package, which installs it
PATCHES_IMPORTED_BY = (PACKAGE,)


def module_files(root=ROOT, package=PACKAGE):
    """{dotted module name: path} of every .py file in the package (``__init__`` -> package)."""
    out = {}
    base = os.path.join(root, package)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, name)
    return out


def _known(name, modules):
    """The longest prefix of ``name`` that is one of ``modules`` (None: outside the package)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module, path, modules):
    """The package modules ``module`` (file ``path``) imports, with the line of each import."""
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = os.path.basename(path) == "__init__.py"
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    found = {}

    def add(target, line):
        if target is not None and target != module:
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_known(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                keep = len(package_parts) - (node.level - 1)
                base_parts = package_parts[:keep] if keep > 0 else []
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else _known(base, modules), node.lineno)
    return found


def import_graph(root=ROOT):
    modules = module_files(root)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(out)


def _layer(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_arrows(graph):
    """(importer, imported, line) for every import that breaks FORBIDDEN."""
    bad = []
    for module, targets in sorted(graph.items()):
        forbidden = FORBIDDEN.get(_layer(module), ())
        for target, line in sorted(targets.items()):
            if _layer(target) in forbidden:
                bad.append((module, target, line))
    return bad


def _describe_cycle(graph, comp):
    members = set(comp)
    edges = [f"{a} -> {b} (line {line})" for a in comp for b, line in sorted(graph[a].items())
             if b in members]
    return "cycle " + ", ".join(comp) + ":\n    " + "\n    ".join(edges)


# ---------------------------------------------------------------- tests
def test_graph_is_read_from_the_source():
    graph = import_graph()
    assert f"{PACKAGE}.ops.layer_norm" in graph and f"{PACKAGE}.ops._extension" in graph
    # a lazy (function-level) relative import is an edge: the public op -> its binding
    assert f"{PACKAGE}.ops._layer_norm_cuda" in graph[f"{PACKAGE}.ops.layer_norm"]
    assert f"{PACKAGE}.ops._extension" in graph[f"{PACKAGE}.ops.layer_norm"]


def test_cycle_finder_sees_two_file_and_function_level_cycles(tmp_path):
    pkg = tmp_path / PACKAGE / "ops"
    pkg.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from ._a_cuda import g\n    return g()\n")
    (pkg / "_a_cuda.py").write_text("from .a import f\n")
    (pkg / "b.py").write_text("from .. import models\n")
    (tmp_path / PACKAGE / "models.py").write_text("")
    graph = import_graph(str(tmp_path))
    assert cycles(graph) == [[f"{PACKAGE}.ops._a_cuda", f"{PACKAGE}.ops.a"]]
    assert upward_arrows(graph) == [(f"{PACKAGE}.ops.b", f"{PACKAGE}.models", 1)]


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles in ls_fairseq:\n" + "\n".join(
        _describe_cycle(graph, c) for c in found)


def test_no_upward_import():
    bad = upward_arrows(import_graph())
    assert not bad, "imports against the layering (see this file's doc):\n" + "\n".join(
        f"  {a} imports {b} (line {line})" for a, b, line in bad)


def test_only_the_package_imports_the_fairseq_patches():
    graph = import_graph()
    patches = f"{PACKAGE}.fairseq_patches"
    assert patches in graph and f"{patches}.p07_fixed_batches" in graph[patches]
    assert f"{PACKAGE}.data.batch_order" in graph[f"{patches}.p07_fixed_batches"]
    importers = sorted(m for m, targets in graph.items()
                       if any(t == patches or t.startswith(patches + ".") for t in targets)
                       and not m.startswith(patches))
    assert importers == list(PATCHES_IMPORTED_BY), importers


def optim_imports_of_graphs_internals(graph):
    """(importer, imported, line) for every import by a module of ``optim`` of a module inside
    ``graphs`` (the package itself, its public names, is allowed)."""
    optim, graphs = f"{PACKAGE}.optim", f"{PACKAGE}.graphs"
    return [(m, t, line) for m, targets in sorted(graph.items())
            if m == optim or m.startswith(optim + ".")
            for t, line in sorted(targets.items()) if t.startswith(graphs + ".")]


def test_optim_uses_no_graphs_internals():
    """The optimizer learns what the engine did from ``distributed`` (the update's
    ``GradientExchange``), not from the engine's modules."""
    bad = optim_imports_of_graphs_internals(import_graph())
    assert not bad, "optim importing graphs internals:\n" + "\n".join(
        f"  {a} imports {b} (line {line})" for a, b, line in bad)


def test_optim_rule_sees_a_graphs_internal(tmp_path):
    pkg = tmp_path / PACKAGE
    for sub in ("optim", "graphs"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "graphs" / "replay.py").write_text("")
    (pkg / "optim" / "a.py").write_text("from ..graphs import replay\nfrom .. import graphs\n")
    graph = import_graph(str(tmp_path))
    assert optim_imports_of_graphs_internals(graph) == [
        (f"{PACKAGE}.optim.a", f"{PACKAGE}.graphs.replay", 1)]


def test_bindings_never_import_their_public_module():
    """``ops/_<op>_cuda.py`` binds the CUDA op; the public ``ops/<op>.py`` dispatches to it and
    owns the fallback, so the arrow goes one way only (ls_fairseq/ops/README.md)."""
    graph = import_graph()
    ops = f"{PACKAGE}.ops."
    public = {m for m in graph if m.startswith(ops) and not m[len(ops):].startswith("_")}
    bad = [(m, t) for m in graph if m.startswith(ops + "_") and m.endswith("_cuda")
           for t in graph[m] if t in public or t == PACKAGE + ".ops"]
    assert not bad, "bindings importing public op modules: " + ", ".join(f"{a} -> {b}" for a, b in bad)


if __name__ == "__main__":
    g = import_graph()
    for comp in cycles(g):
        print(_describe_cycle(g, comp))
    for a, b, line in upward_arrows(g) + optim_imports_of_graphs_internals(g):
        print(f"upward: {a} imports {b} (line {line})")
