"""How a patch replaces one attribute of fairseq and gives it back.

A patch names its targets as ``(owner, name, make)``: ``owner`` a fairseq class or module,
``make(original)`` builds the replacement from the attribute as it stands in ``owner``'s own
``__dict__`` (a plain function, or the ``classmethod`` object itself). The replacement carries
the attribute it replaced (:data:`ORIGINAL`), so the state of a patch lives on fairseq's
attribute alone: installed when the attribute carries it, and uninstalling puts back the very
object that was there (the same object, ``is``).
"""

#: the attribute, on a replacement function, that holds the original it replaced
ORIGINAL = "_ls_fairseq_original"
_INHERITED = object()  # the owner had no attribute of its own: uninstall deletes the wrapper's


def _function(attribute):
    """The function of a ``classmethod``/``staticmethod`` object, else ``attribute``."""
    return getattr(attribute, "__func__", attribute)


def _own(owner, name):
    return vars(owner).get(name, _INHERITED)


def _label(owner, name):
    return f"{getattr(owner, '__name__', owner)}.{name}"


def installed(owner, name) -> bool:
    """Whether ``owner.name`` is an ls_fairseq replacement."""
    own = _own(owner, name)
    return own is not _INHERITED and hasattr(_function(own), ORIGINAL)


def original(owner, name):
    """fairseq's own ``owner.name``: the original a replacement holds, or the attribute itself
    where nothing is installed."""
    own = _own(owner, name)
    if installed(owner, name):
        own = getattr(_function(own), ORIGINAL)
    return getattr(owner, name) if own is _INHERITED else own


def wrap(owner, name, make) -> None:
    """Replace ``owner.name`` by ``make(original)`` unless already done."""
    if getattr(owner, name, None) is None:
        raise RuntimeError(f"ls_fairseq: fairseq's {_label(owner, name)} is missing; this "
                           f"fairseq version is not supported (fairseq 0.12 is)")
    if installed(owner, name):
        return
    own = _own(owner, name)
    replacement = make(getattr(owner, name) if own is _INHERITED else own)
    setattr(_function(replacement), ORIGINAL, own)
    setattr(owner, name, replacement)


def unwrap(owner, name) -> None:
    """Put fairseq's own ``owner.name`` back (nothing to do when not installed)."""
    if not installed(owner, name):
        return
    kept = getattr(_function(_own(owner, name)), ORIGINAL)
    if kept is _INHERITED:
        delattr(owner, name)
    else:
        setattr(owner, name, kept)
