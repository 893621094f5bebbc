"""The one results format of bench/: what a benchmark writes with ``--json``, and every file in
docs/results.

A results file is one JSON object:

========== ===================================================================================
key        value
========== ===================================================================================
schema     ``"ls-fairseq-results/1"``
script     the script that made the rows (``bench/e2e.py``; a check under ``scripts/`` too),
           ``unknown`` where nothing says; a script since removed is named as it was
           (docs/results/README.md says where it is)
what       one line: what the rows are (docs/results/README.md lists it)
device     the GPU(s) or CPU the rows were measured on
commit     the commit measured (``LS_BENCH_COMMIT``, else git), with a note where it differs
torch      torch's version
command    the command line(s) that made the rows
date       the day of the measurement, ``YYYY-MM-DD`` (the first, where calls spanned days)
rows       a non-empty list of objects: one measurement each (a run, a configuration, a
           kernel shape), the fields the script documents
========== ===================================================================================

Any other key is the script's own (settings, summaries, notes). ``header_source`` (optional, an
object) says where header values came from when they were added after the run; ``unknown``
stands where nothing says. :func:`write` fills the header, checks the result and writes it
atomically (benchmarks rewrite their file after every row); :func:`problems` is the validator.
"""
import datetime
import json
import os
import re

SCHEMA = "ls-fairseq-results/1"
HEADER = ("schema", "script", "what", "device", "commit", "torch", "command", "date")
DATE = re.compile(r"^\d{4}-\d\d-\d\d$")


def problems(obj):
    """What keeps ``obj`` from being a results file: a list of one-line messages ([] if valid)."""
    if not isinstance(obj, dict):
        return [f"not a JSON object but {type(obj).__name__}"]
    out = []
    if obj.get("schema") != SCHEMA:
        out.append(f"schema: {obj.get('schema')!r}, expected {SCHEMA!r}")
    for key in HEADER[1:]:
        value = obj.get(key)
        if not isinstance(value, str) or not value.strip():
            out.append(f"{key}: a non-empty string is required, got {value!r}")
    date = obj.get("date")
    if isinstance(date, str) and date != "unknown" and not DATE.match(date):
        out.append(f"date: {date!r} is not YYYY-MM-DD (or 'unknown')")
    script = obj.get("script")
    if isinstance(script, str) and script != "unknown" and not re.match(
            r"^(bench|scripts)/[\w./-]+\.(py|sh)$", script):
        out.append(f"script: {script!r} is not a path under bench/ or scripts/ (or 'unknown')")
    rows = obj.get("rows")
    if not isinstance(rows, list) or not rows:
        out.append("rows: a non-empty list is required")
    else:
        bad = [i for i, r in enumerate(rows) if not isinstance(r, dict)]
        if bad:
            out.append(f"rows: items {bad[:5]} are not objects")
    source = obj.get("header_source")
    if source is not None and not isinstance(source, dict):
        out.append("header_source: an object mapping header keys to where they came from")
    return out


def check(obj, where="results"):
    """``obj`` if it is a valid results file, else ValueError naming every problem."""
    found = problems(obj)
    if found:
        raise ValueError(f"{where}: " + "; ".join(found))
    return obj


def load(path):
    with open(path) as f:
        return check(json.load(f), path)


def header(script, what, command, device=None, commit=None, torch=None, date=None):
    """The header of a run started now: device, commit and torch from the environment unless
    given (``env``: no CUDA context is made)."""
    from benchlib import env

    return {"schema": SCHEMA, "script": script, "what": what,
            "device": device or ", ".join(env.gpu_names()),
            "commit": commit or env.commit(), "torch": torch or env.torch_version(),
            "command": command, "date": date or str(datetime.date.today())}


def write(path, head, rows, **extra):
    """Writes ``head`` (``header``), ``extra`` and ``rows`` to ``path`` after checking them, by a
    rename (a reader never sees half a file). Returns the object written."""
    obj = check(dict(head, **extra, rows=rows), path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return obj
