"""docs/DESIGN.md draws one training update with boxes that name modules of ``ls_fairseq``
(``graphs/replay``, ``distributed/reducer`` ...): each named module must exist, so the drawing
cannot silently go stale when a module moves."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOMS = ("graphs", "distributed", "optim", "criterions", "fairseq_patches", "models", "modules",
         "ops", "data", "generation")


def named_modules(text):
    """The ``room/module`` names in ``text`` (room: a subpackage of ls_fairseq)."""
    return sorted(set(re.findall(r"\b((?:%s)/[a-z0-9_]+)" % "|".join(ROOMS), text)))


def test_every_module_the_design_names_exists():
    with open(os.path.join(ROOT, "docs", "DESIGN.md")) as f:
        names = named_modules(f.read())
    assert len(names) >= 15  # the drawing names the rooms' modules, not just a few
    package = os.path.join(ROOT, "ls_fairseq")
    missing = [n for n in names if not (os.path.isfile(os.path.join(package, n + ".py"))
                                        or os.path.isdir(os.path.join(package, n)))]
    assert not missing, f"docs/DESIGN.md names modules that do not exist: {missing}"


def test_a_moved_module_is_caught():
    assert named_modules("graphs/replay -> graphs/peer_all_reduce") == \
        ["graphs/peer_all_reduce", "graphs/replay"]
    assert not os.path.isfile(os.path.join(ROOT, "ls_fairseq", "graphs", "peer_all_reduce.py"))
