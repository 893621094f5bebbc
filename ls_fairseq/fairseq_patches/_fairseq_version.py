"""The fairseq versions the patches are written for, and the one line for any other.

Each patch wraps fairseq methods by name and relies on what they do, so on another fairseq a
patch could silently do the wrong thing where the method still exists. ``LS_FAIRSEQ_ANY_FAIRSEQ=1``
installs them anyway (say, on a fork of 0.12.2 with another version string), with a warning;
each wrapper still refuses a method that is missing.
"""
import logging
import sys

#: what the message names as supported
SUPPORTED = "fairseq 0.12.2 and fairseq-fixed 0.12.3.x"
OVERRIDE = "LS_FAIRSEQ_ANY_FAIRSEQ"
INSTALL = "pip install --no-build-isolation fairseq-fixed==0.12.3.1"

logger = logging.getLogger(__package__)


class UnsupportedFairseq(RuntimeError):
    """The installed fairseq is not one the patches were written for (one-line message)."""


def supported(version: str) -> bool:
    """``version`` (``fairseq.__version__``) is 0.12.2 or fairseq-fixed's 0.12.3[.x]."""
    base = str(version).split("+")[0]  # a local build: 0.12.2+abc
    return base in ("0.12.2", "0.12.3") or base.startswith("0.12.3.")


def installed_version() -> str:
    import fairseq

    return str(getattr(fairseq, "__version__", "unknown"))


def message(version: str) -> str:
    return (f"fairseq {version} is installed, and the plugin's patches to fairseq are written for "
            f"{SUPPORTED}: install one of them ({INSTALL}), or set {OVERRIDE}=1 to try "
            f"fairseq {version} anyway")


def check_fairseq_version(warn: bool = False) -> None:
    """UnsupportedFairseq unless the installed fairseq is supported or ``LS_FAIRSEQ_ANY_FAIRSEQ``
    is set (``warn``: then say so, once per caller)."""
    from ..ops._extension import env_flag

    version = installed_version()
    if supported(version):
        return
    if env_flag(OVERRIDE):
        if warn:
            logger.warning(f"ls_fairseq: fairseq {version} is not one the patches were written "
                           f"for ({SUPPORTED}); installing them anyway ({OVERRIDE}=1)")
        return
    raise UnsupportedFairseq(message(version))


def refuse_unsupported_fairseq() -> None:
    """When the plugin loads: an unsupported fairseq ends the process with one line on stderr
    and exit status 2, as a bad ``LS_FAIRSEQ_*`` variable does."""
    try:
        check_fairseq_version(warn=True)
    except UnsupportedFairseq as exc:
        sys.stdout.flush()
        sys.stderr.write(f"ls_fairseq: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
