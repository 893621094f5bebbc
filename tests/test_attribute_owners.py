"""No room of the package sets the engine's or the optimizer's hand-off state on another room's
object: the source of ``ls_fairseq`` is read with ``ast`` (nothing is imported) for assignments
(``x.attr = ...``, ``x.attr += ...``, ``setattr(x, "attr", ...)``) of the attributes that used to
carry the hand-off between the step engine and ls_adam as flags.

What happened to an update's gradients now travels as one ``distributed.GradientExchange``
(``distributed/exchange.py``); the copy-engine all-reduce's phase 4 is turned off by its own
method (``PeerAllReduce.scatter_only_from_next_update``); LSAdam gets its consolidation through
``LSAdam.register_consolidate``. So each watched attribute may be assigned only on ``self`` inside
the module that owns it (``OWNERS``), or nowhere.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ls_fairseq"

#: watched attribute -> the module (path under the repository) that may set it on ``self``;
#: None: no module may set it
OWNERS = {
    "all_reduced": None,
    "scattered": None,
    "peer_reduce": None,
    "scatter_only": "ls_fairseq/distributed/peer_all_reduce.py",
    "consolidate": None,
}


def _targets(node):
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def foreign_assignments(root=ROOT, owners=None):
    """(path, line, attribute) of every assignment of a watched attribute outside its owner."""
    owners = OWNERS if owners is None else owners
    bad = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, PACKAGE)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path) as f:
                tree = ast.parse(f.read(), filename=path)
            for node in ast.walk(tree):
                found = [(t.value, t.attr) for t in _targets(node)
                         if isinstance(t, ast.Attribute) and t.attr in owners]
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "setattr" and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant)
                        and node.args[1].value in owners):
                    found.append((node.args[0], node.args[1].value))
                for obj, attr in found:
                    on_self = isinstance(obj, ast.Name) and obj.id == "self"
                    if not (owners[attr] == rel and on_self):
                        bad.append((rel, node.lineno, attr))
    return bad


def test_no_room_sets_another_rooms_hand_off_state():
    bad = foreign_assignments()
    assert not bad, "assignments outside the attribute's owner (see this file's doc):\n" + \
        "\n".join(f"  {path}:{line}: .{attr} =" for path, line, attr in bad)


def test_the_check_sees_every_form(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "distributed").mkdir(parents=True)
    (pkg / "a.py").write_text(
        "def f(grads, opt, peer):\n"
        "    grads.all_reduced = True\n"
        "    x, opt.optimizer.consolidate = 1, f\n"
        "    peer.scatter_only |= True\n"
        "    setattr(grads, 'peer_reduce', peer)\n"
        "    grads.other = 1\n")
    (pkg / "distributed" / "peer_all_reduce.py").write_text(
        "class P:\n"
        "    def __init__(self, other):\n"
        "        self.scatter_only = False\n"
        "        other.scatter_only = True\n")
    assert foreign_assignments(str(tmp_path)) == [
        ("ls_fairseq/a.py", 2, "all_reduced"), ("ls_fairseq/a.py", 3, "consolidate"),
        ("ls_fairseq/a.py", 4, "scatter_only"), ("ls_fairseq/a.py", 5, "peer_reduce"),
        ("ls_fairseq/distributed/peer_all_reduce.py", 4, "scatter_only")]
