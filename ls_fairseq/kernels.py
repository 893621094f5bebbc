"""Which CUDA kernels this install has, how they were built, for which GPUs, and which build a
process here uses and why. Works without a GPU (it then says so, and what is prebuilt).

    python -m ls_fairseq.kernels           # the report; loads the prebuilt module if it matches
    python -m ls_fairseq.kernels --load    # also loads the kernels (building them just in time
                                           # if need be) and lists the ops they register
    python -m ls_fairseq.kernels --json    # the report as one JSON object

Exit status 0; with ``--load``, 1 when the kernels are unavailable (the reason is printed).
The decision is ``ls_fairseq/ops/_extension.py``'s own (``prebuilt_choice``), not a copy.
"""
import argparse
import glob
import json
import os
import re
import sys

from . import __version__
from .ops import _extension


def defined_ops(directory):
    """The names of the ops csrc/ defines (``m.def("name(...) -> ...")``), sorted."""
    names = set()
    for path in glob.glob(os.path.join(directory, "*.cu")) + glob.glob(os.path.join(directory, "*.cpp")):
        with open(path) as f:
            for match in re.finditer(r'm\.def\(((?:\s*"[^"]*")+)', f.read()):
                schema = "".join(re.findall(r'"([^"]*)"', match.group(1)))  # adjacent literals
                names.add(schema.split("(")[0].strip())
    return sorted(names)


def _jit_cache(directory):
    """(the folder of the just-in-time build of these sources, whether it is built already)."""
    from torch.utils import cpp_extension

    name = _extension.jit_name(directory)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    folder = os.path.join(root, name)
    return folder, os.path.exists(os.path.join(folder, f"{name}.so"))


def report(load=False) -> dict:
    """The report as a dict (``--json`` prints it). ``load``: load the kernels even when that
    means building them just in time."""
    import torch
    from torch.utils import cpp_extension

    out = {
        "ls_fairseq": __version__,
        "package": _extension.package_dir(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "mode": _extension.mode(),
    }
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out["gpus"] = [{"index": i, "name": torch.cuda.get_device_name(i),
                    "capability": "%d.%d" % torch.cuda.get_device_capability(i)} for i in range(count)]
    try:
        record = _extension.prebuilt_record()
        out["prebuilt"] = record and {k: v for k, v in record.items() if k != "_path"}
        if record:
            out["prebuilt"]["path"] = record["_path"]
            out["prebuilt"]["present"] = os.path.exists(record["_path"])
    except (OSError, ValueError) as exc:
        record, out["prebuilt"], out["prebuilt_error"] = None, None, str(exc)
    try:
        directory = _extension.csrc_dir()
    except FileNotFoundError as exc:
        directory, out["csrc_error"] = None, str(exc)
    digest = _extension._sources_digest(directory) if directory else None
    out["sources"] = digest
    if out.get("prebuilt_error"):
        use, why = False, f"the prebuilt CUDA kernels' build record is unreadable ({out['prebuilt_error']})"
    else:
        use, why = _extension.prebuilt_choice(record, _extension.runtime(), digest,
                                              (_extension.CXX_FLAGS, _extension.CUDA_FLAGS))
    out["jit"] = {"nvcc": os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
                  if cpp_extension.CUDA_HOME else None}
    if directory:
        out["jit"]["cache"], out["jit"]["cached"] = _jit_cache(directory)
    if count:
        build = "prebuilt" if use else "just in time"
    else:  # what a GPU would get: the prebuilt module where its code runs, else the JIT build
        build = "none"
        if record is not None and why == "no CUDA device is visible to torch":
            gpu = (f"the prebuilt module where its GPU code runs "
                   f"({' '.join(record.get('gpu_code', []))}), else the just-in-time build")
        else:
            gpu = f"the just-in-time build: {why}"
        why = f"no CUDA device. On a GPU: {gpu}"
    out["choice"] = {"build": build, "why": why}  # under LS_FAIRSEQ_KERNELS=off: what it would be
    out["ops"] = defined_ops(directory) if directory else []
    if count and ((use and out["mode"] != "off") or load):
        ok = _extension.load()
        out["loaded"] = ok
        out["origin"] = _extension.origin()
        if ok:
            out["registered"] = [n for n in out["ops"] if hasattr(torch.ops.ls_fairseq, n)]
        else:
            out["failure"] = _extension.failure_reason()
    return out


def format_report(r: dict) -> str:
    lines = [f"ls_fairseq {r['ls_fairseq']} ({r['package']}); torch {r['torch']} "
             f"({'CUDA ' + r['torch_cuda'] if r['torch_cuda'] else 'a CPU build'}); "
             f"LS_FAIRSEQ_KERNELS={r['mode']}"]
    gpus = ", ".join(f"{g['index']}: {g['name']} (sm_{g['capability'].replace('.', '')})"
                     for g in r["gpus"])
    lines.append(f"GPUs: {gpus or 'no CUDA device'}")
    p = r.get("prebuilt")
    if r.get("prebuilt_error"):
        lines.append(f"prebuilt: unreadable build record ({r['prebuilt_error']})")
    elif not p:
        lines.append("prebuilt: none in this install (installed without LS_FAIRSEQ_BUILD_KERNELS=1)")
    else:
        same = "same as the shipped csrc/" if p.get("sources") == r.get("sources") else \
            f"the shipped csrc/ is {r.get('sources')}"
        lines += [
            f"prebuilt: {p['path']}{'' if p.get('present') else ' (MISSING)'}",
            f"  built {p.get('built', '?')} for torch {p.get('torch')}, CUDA {p.get('torch_cuda')} "
            f"(nvcc {p.get('nvcc', '?')})",
            f"  GPU code {' '.join(p.get('gpu_code', [])) or 'none'} "
            f"(TORCH_CUDA_ARCH_LIST: {p.get('arch_list', '?')})",
            f"  flags: c++ {' '.join(p.get('cxx_flags', []))}; nvcc {' '.join(p.get('cuda_flags', []))}; "
            f"sources {p.get('sources')} ({same})",
        ]
    jit = r["jit"]
    cache = f"; cache {jit['cache']} ({'built' if jit.get('cached') else 'not built yet'})" \
        if jit.get("cache") else ""
    nvcc = jit["nvcc"] or ("not found (set CUDA_HOME)" if r["torch_cuda"] else
                           "none (a CPU build of torch builds no CUDA code)")
    lines.append(f"just in time: nvcc {nvcc}{cache}")
    choice = r["choice"]
    what = {"prebuilt": "the prebuilt module", "just in time": "the just-in-time build",
            "none": "the PyTorch reference path"}[choice["build"]]
    if r["mode"] == "off":
        lines.append(f"this process: the PyTorch reference path (LS_FAIRSEQ_KERNELS=off); without "
                     f"it: {what}: {choice['why']}")
    else:
        lines.append(f"this process: {what}: {choice['why']}")
    ops = r["ops"]
    if "registered" in r:
        origin = r.get("origin", {})
        got = set(r["registered"])
        missing = [n for n in ops if n not in got]
        lines.append(f"loaded ({origin.get('kind', '?')}, GPU code {' '.join(origin.get('gpu_code', []))}): "
                     f"{len(got)} of {len(ops)} ops registered"
                     + (f"; missing {', '.join(missing)}" if missing else ""))
    elif "failure" in r:
        lines.append(f"not loaded: {r['failure']}")
    lines.append(f"kernels ({len(ops)} ops in csrc/): {', '.join(ops)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ls_fairseq.kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", action="store_true",
                        help="load the kernels, building them just in time if need be")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    r = report(load=args.load)
    print(json.dumps(r, indent=1, sort_keys=True) if args.json else format_report(r))
    return 1 if args.load and not r.get("loaded") else 0


if __name__ == "__main__":
    sys.exit(main())
