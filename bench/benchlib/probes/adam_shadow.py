#!/usr/bin/env python3
"""fairseq-train with ls_adam's fused fp16 step checked against fairseq's Adam at every update.

A diagnostic for the optimizer path of the plain command (``--optimizer ls_adam --fp16``: the
fused fp16 copy and the deferred overflow check). Before each step it snapshots what the step
reads (the fp16 gradients, the multiply factor, the flat fp32 master and Adam moments, the
learning rate); after it, it recomputes the step with the operations of fairseq's own
``Adam.step`` on that snapshot and compares:

* the fp32 master, ``exp_avg`` and ``exp_avg_sq`` (in units of the float32 spacing at the
  reference value, for the master at the larger of it and the value before the step: rounding
  alone stays within a few units);
* the fp16 model weights against the new master rounded to fp16 (must be equal);
* the Adam step count against the number of steps that really updated the weights;
* an update whose scaled gradients are not finite must leave everything untouched.

Each update is one JSON line in ``--out``; the last line of the run's output is ``SHADOW_SUMMARY
{...}`` (worst errors, mismatch counts, overflows), which ``bench/quality.py`` reads (its
``optimizer_shadow`` variant runs this program). It changes
no result: the step itself is ls_adam's, and the checks only read (they add host reads, so time
is not representative).

    python bench/benchlib/probes/adam_shadow.py --out shadow.jsonl -- DATA --arch transformer \\
        --optimizer ls_adam --fp16 --user-dir ls_fairseq ...      # fairseq-train's arguments
"""
import argparse
import json
import sys

#: float32 spacings (units in the last place) that count as rounding, not a different step
MAX_ULPS = 8.0


def _ulps(x, ref, operand=None):
    """max |x - ref| in float32 spacings at max(|ref|, |operand|) (2^-23 relative, at least the
    smallest normal's spacing). The master's ``operand`` is its value before the step: where the
    step nearly cancels it, the new value is tiny and its own spacing far below the rounding of
    ``p - step``, which is the spacing of ``p``."""
    import torch

    scale = ref.abs() if operand is None else torch.maximum(ref.abs(), operand.abs())
    spacing = scale.clamp_min(torch.finfo(torch.float32).tiny) * 2.0 ** -23
    return float(((x.double() - ref.double()).abs() / spacing.double()).max())


class Shadow:
    """The per-update check around ``LSFusedFP16Optimizer.step`` (module docstring)."""

    def __init__(self, out):
        self.out = out
        self.updates = self.real_steps = self.overflows = 0
        self.worst = dict(master=0.0, exp_avg=0.0, exp_avg_sq=0.0)
        self.bad = dict(master=0, exp_avg=0, exp_avg_sq=0, fp16=0, step=0, untouched=0)

    def wrap(self, original):
        import torch

        shadow = self

        @torch.no_grad()
        def step(opt, closure=None, groups=None):
            master = opt.master
            adam = opt.fp32_optimizer.optimizer
            if not torch.is_tensor(master):
                return original(opt, closure, groups)  # per-tensor masters: not checked here
            params = [p for p in opt.fp16_params if p.requires_grad]
            grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                               .reshape(-1).float() for p in params])
            factor = opt._multiply_factor
            state = adam.state.get(master, {})
            p0 = master.data.clone()
            m0 = state["exp_avg"].clone() if "exp_avg" in state else torch.zeros_like(p0)
            v0 = state["exp_avg_sq"].clone() if "exp_avg_sq" in state else torch.zeros_like(p0)
            group = adam.param_groups[0]
            result = original(opt, closure, groups)
            state = adam.state[master]
            shadow.check(p0, m0, v0, grads, factor, group, state, master, params)
            return result

        return step

    def check(self, p0, m0, v0, grads, factor, group, state, master, params):
        import math

        import torch

        self.updates += 1
        g = grads * factor  # fairseq: the fp32 copy of the grads times its multiply factor
        finite = bool(torch.isfinite(g).all())
        row = dict(update=self.updates, finite=finite, step=int(state["step"]),
                   lr=float(group["lr"]), factor=float(factor))
        p1, m1, v1 = master.data, state["exp_avg"], state["exp_avg_sq"]
        if not finite:
            self.overflows += 1
            same = bool(torch.equal(p1, p0) and torch.equal(m1, m0) and torch.equal(v1, v0))
            self.bad["untouched"] += not same
            row["untouched"] = same
        else:
            self.real_steps += 1
            row["expected_step"] = self.real_steps
            self.bad["step"] += row["step"] != self.real_steps
            beta1, beta2 = group["betas"]
            m, v, p = m0.clone(), v0.clone(), p0.clone()  # fairseq's Adam.step, op by op
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = v.sqrt().add_(group["eps"])
            step = self.real_steps
            step_size = group["lr"] * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
            if group["weight_decay"] != 0:
                p.add_(p, alpha=-group["weight_decay"] * group["lr"])
            p.addcdiv_(m, denom, value=-step_size)
            for name, got, ref, operand in (("master", p1, p, p0), ("exp_avg", m1, m, None),
                                            ("exp_avg_sq", v1, v, None)):
                ulps = _ulps(got, ref, operand)
                row[name + "_ulps"] = ulps
                self.worst[name] = max(self.worst[name], ulps)
                self.bad[name] += ulps > MAX_ULPS
        copies = torch.cat([q.detach().reshape(-1) for q in params])
        mismatched = int((copies != p1.to(copies.dtype)).sum())
        row["fp16_mismatches"] = mismatched
        self.bad["fp16"] += mismatched > 0
        self.out.write(json.dumps(row) + "\n")
        self.out.flush()

    def summary(self):
        return dict(updates=self.updates, real_steps=self.real_steps, overflows=self.overflows,
                    worst_ulps=self.worst, bad_updates=self.bad, max_ulps=MAX_ULPS)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        sys.exit("usage: adam_shadow.py --out FILE -- FAIRSEQ_TRAIN_ARGS...")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="one JSON line per update")
    a = p.parse_args(argv[:cut])

    import ls_fairseq  # noqa: F401  (registers ls_adam; --user-dir imports it again: a no-op)
    from fairseq_cli import train
    from ls_fairseq.optim.ls_adam import LSFusedFP16Optimizer

    with open(a.out, "w") as out:
        shadow = Shadow(out)
        LSFusedFP16Optimizer.step = shadow.wrap(LSFusedFP16Optimizer.step)
        sys.argv = ["fairseq-train"] + argv[cut + 1:]
        try:
            train.cli_main()
        finally:
            print("SHADOW_SUMMARY " + json.dumps(shadow.summary()), flush=True)


if __name__ == "__main__":
    main()
