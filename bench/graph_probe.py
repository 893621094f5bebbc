#!/usr/bin/env python3
"""Where does --ls-cuda-graphs capture fail? Runs each configuration in its own process (a failed
capture leaves the CUDA generator in capture state) and prints one line per configuration:
ok / the exception, the call at which it happened, and the innermost frames of its traceback.

    python bench/graph_probe.py            # all configurations
    python bench/graph_probe.py small_p03  # one
"""
import json
import os
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SMALL = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64",
         "--encoder-ffn-embed-dim", "136", "--encoder-attention-heads", "4",
         "--decoder-attention-heads", "4", "--share-all-embeddings"]


def drop(p, att=None, act=None):
    return ["--dropout", str(p), "--attention-dropout", str(p if att is None else att),
            "--activation-dropout", str(p if act is None else act)]


BIG = ["--share-all-embeddings"]
CONFIGS = {
    "small_p03": dict(arch="ls_transformer", extra=SMALL + drop(0.3)),
    "small_p02": dict(arch="ls_transformer", extra=SMALL + drop(0.2)),
    "small_p03_seeded": dict(arch="ls_transformer", extra=SMALL + drop(0.3), seed_each=True),
    "small_p03_gradnone": dict(arch="ls_transformer", extra=SMALL + drop(0.3), grad_none=True),
    "small_att_only": dict(arch="ls_transformer", extra=SMALL + drop(0.0, att=0.3)),
    "small_act_only": dict(arch="ls_transformer", extra=SMALL + drop(0.0, act=0.3)),
    "small_res_only": dict(arch="ls_transformer", extra=SMALL + drop(0.3, att=0.0, act=0.0)),
    "small_p03_threadlocal": dict(arch="ls_transformer", extra=SMALL + drop(0.3),
                                  mode="thread_local"),
    "small_p03_relaxed": dict(arch="ls_transformer", extra=SMALL + drop(0.3), mode="relaxed"),
    "small_p03_softmax": dict(arch="ls_transformer", extra=SMALL + drop(0.3),
                              env={"LS_FAIRSEQ_ATTENTION": "softmax"}),
    "small_p0": dict(arch="ls_transformer", extra=SMALL + drop(0.0)),
    "big_fp16_p0": dict(arch="ls_transformer_wmt_en_de_big_t2t", extra=BIG + drop(0.0),
                        dtype="half", shape=(96, 31, 33)),
    "big_fp16": dict(arch="ls_transformer_wmt_en_de_big_t2t", extra=BIG, dtype="half",
                     shape=(96, 31, 33)),
    "big_fp16_att0": dict(arch="ls_transformer_wmt_en_de_big_t2t", extra=BIG + ["--attention-dropout", "0"],
                          dtype="half", shape=(96, 31, 33)),
    "big_fp16_act0": dict(arch="ls_transformer_wmt_en_de_big_t2t", extra=BIG + ["--activation-dropout", "0"],
                          dtype="half", shape=(96, 31, 33)),
    "bisect_small_p0": dict(arch="ls_transformer", extra=SMALL + drop(0.0), bisect=True),
    "bisect_big": dict(arch="ls_transformer_wmt_en_de_big_t2t", extra=BIG, dtype="half",
                       shape=(96, 31, 33), bisect=True),
    "syncdebug_big": dict(arch="ls_transformer_wmt_en_de_big_t2t", extra=BIG, dtype="half",
                          shape=(96, 31, 33), syncdebug=True),
    "syncdebug_small": dict(arch="ls_transformer", extra=SMALL + drop(0.3), syncdebug=True),
}


def child(name):
    cfg = CONFIGS[name]
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from fairseq_helpers import DummyTask, build_model, make_dictionary, random_batch
    from ls_fairseq.criterions.ls_label_smoothed_cross_entropy import (
        LSLabelSmoothedCrossEntropyCriterion,
    )

    mode = cfg.get("mode")
    if mode:
        begin = torch.cuda.CUDAGraph.capture_begin

        def capture_begin(self, pool=None, capture_error_mode="global"):
            return begin(self, pool=pool, capture_error_mode=mode)

        torch.cuda.CUDAGraph.capture_begin = capture_begin
    d = make_dictionary(203 if cfg["arch"] == "ls_transformer" else 32003)
    dtype = torch.float16 if cfg.get("dtype") == "half" else torch.float32
    model = build_model(cfg["arch"], d, cfg["extra"], seed=5).cuda().to(dtype).train()
    crit = LSLabelSmoothedCrossEntropyCriterion(DummyTask(d), sentence_avg=False,
                                                label_smoothing=0.1,
                                                ls_cuda_graphs=not cfg.get("syncdebug"))
    g = torch.Generator().manual_seed(1)
    src, lens, prev, tgt = random_batch(d, *cfg.get("shape", (6, 17, 19)), generator=g)
    sample = {"net_input": {"src_tokens": src.cuda(), "src_lengths": lens.cuda(),
                            "prev_output_tokens": prev.cuda()}, "target": tgt.cuda(),
              "ntokens": int(tgt.ne(d.pad()).sum())}
    if cfg.get("syncdebug"):
        crit(model, sample)[0].backward()  # first call: lazy set-up may sync legitimately
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = crit(model, sample)[0]
            loss.backward()
            torch.cuda.set_sync_debug_mode(0)
            return {"result": "no host sync in an eager fwd+bwd"}
        except Exception as e:  # noqa: BLE001 - report whatever it was
            torch.cuda.set_sync_debug_mode(0)
            return {"result": "SYNC", "error": str(e).splitlines()[0][:200],
                    "where": [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                              for f in traceback.extract_tb(e.__traceback__)][-8:]}
    if cfg.get("bisect"):
        return bisect(crit, model, sample)
    losses = []
    for call in range(4):
        try:
            if cfg.get("seed_each"):
                torch.manual_seed(call)
            if cfg.get("grad_none"):
                for p in model.parameters():
                    p.grad = None
            loss = crit(model, sample)[0]
            (loss * (128.0 if dtype == torch.float16 else 1.0)).backward()
            losses.append(round(float(loss), 4))
        except Exception as e:  # noqa: BLE001
            return {"result": "FAIL", "call": call, "stats": dict(crit.graphs.stats),
                    "errors": chain(e)}
    return {"result": "ok", "stats": dict(crit.graphs.stats), "losses": losses}


def chain(e):
    """The exception and the ones it was raised while handling (a capture_end in a finally
    masks the error that broke the capture)."""
    out = []
    while e is not None and len(out) < 4:
        out.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:240]}",
                    "where": [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                              for f in traceback.extract_tb(e.__traceback__)][-6:]})
        e = e.__context__
    return out


def _capture_status_fn():
    """cudaStreamIsCapturing through ctypes (legal during capture, unlike most queries)."""
    import ctypes

    path = next(l.split()[-1] for l in open("/proc/self/maps") if "libcudart" in l)
    lib = ctypes.CDLL(path)

    def status(stream):
        s = ctypes.c_int(-1)
        lib.cudaStreamIsCapturing(ctypes.c_void_p(stream), ctypes.byref(s))
        return s.value  # 0 none, 1 active, 2 invalidated

    return status


def bisect(crit, model, sample):
    """Capture the backward with a hook before and after every autograd node that reads the
    capture status of the stream: the first node after which it reads 'invalidated' broke it."""
    import torch

    runner = crit.graphs
    crit(model, sample)[0].backward()  # first sighting: eager
    runner._setup(model)
    status = _capture_status_fn()
    compute = crit._losses
    stream = runner._stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up as _capture does
        outputs = compute(model, sample)
        runner._grads(outputs, torch.ones_like(outputs[0]))
    torch.cuda.synchronize()
    fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    res = {}
    with torch.cuda.stream(stream):
        fwd.capture_begin(pool=runner._pool)
        try:
            outputs = compute(model, sample)
            res["after_fwd"] = status(stream.cuda_stream)
        finally:
            try:
                fwd.capture_end()
                res["fwd"] = "ok"
            except Exception as e:  # noqa: BLE001
                res["fwd"] = chain(e)
                return res
        log, seen, todo = [], set(), [outputs[0].grad_fn]
        while todo:  # every node of the backward graph
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            name = node.name()
            node.register_prehook(lambda g, name=name: log.append((name, "pre", status(stream.cuda_stream))) and None)
            node.register_hook(lambda gi, go, name=name: log.append((name, "post", status(stream.cuda_stream))) and None)
            todo.extend(n for n, _ in node.next_functions)
        res["nodes"] = len(seen)
        grad_output = torch.ones_like(outputs[0])
        bwd.capture_begin(pool=runner._pool)
        err = None
        try:
            runner._grads(outputs, grad_output)
        except Exception as e:  # noqa: BLE001
            err = chain(e)
        res["after_bwd"] = status(stream.cuda_stream)
        try:
            bwd.capture_end()
            res["bwd"] = "ok"
        except Exception as e:  # noqa: BLE001
            res["bwd"] = chain(e)
        res["bwd_body_error"] = err
    first_bad = next((i for i, x in enumerate(log) if x[2] != 1), None)
    res["first_bad"] = None if first_bad is None else log[max(0, first_bad - 3):first_bad + 2]
    res["log_len"] = len(log)
    return res


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print("PROBE " + json.dumps(child(sys.argv[2])), flush=True)
        return 0
    names = sys.argv[1:] or list(CONFIGS)
    for name in names:
        env = dict(os.environ, **CONFIGS[name].get("env", {}))
        t = time.time()
        p = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True,
                           text=True, env=env, cwd=ROOT)
        lines = [l for l in p.stdout.splitlines() if l.startswith("PROBE ")]
        res = lines[-1][6:] if lines else f"no result rc={p.returncode}: " + \
            " | ".join(p.stderr.strip().splitlines()[-4:])[-600:]
        print(f"{name:24s} {time.time() - t:5.1f}s {res}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
