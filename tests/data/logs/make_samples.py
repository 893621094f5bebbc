"""Regenerate the hand-specified fairseq log samples in this directory.

    python tests/data/logs/make_samples.py

The numbers are made up (chosen so that tests/test_compare.py can check exact values), but every
line is written by fairseq 0.12's own code: the progress bars of fairseq/logging/progress_bar.py
(simple and json formats), the config dump of fairseq_cli/train.py (str of the real omegaconf
config), the CUDA banner of fairseq.utils.CudaEnvironment, and the logging format of
fairseq_cli/train.py ("%(asctime)s | %(levelname)s | %(name)s | %(message)s") or, for the
``--log-file`` sample, the bare FileHandler that fairseq attaches (including fairseq 0.12's
behaviour of attaching one more handler to the progress-bar logger every epoch, so that epoch k
repeats each progress line k times). Only the clock is simulated.

Samples (one simulated H100 80GB, fp16, transformer big t2t, 400 updates per epoch,
--log-interval 100):

* baseline_simple/train.log: fairseq baseline, --log-format simple, 3 epochs, done.
* ls_json/train.log: ls_ plugin run, --log-format json, 3 epochs, done (2.5x the ups).
* baseline_simple/eval, ls_json/eval: generate output, sacrebleu.json, compound_split_bleu.txt.
* logfile_simple/train.fairseq.log: the baseline run as written by --log-file (no timestamps,
  duplicated lines).
* interrupted_simple.log: killed in epoch 2 at update 700 (no traceback, no 'done training').
* restart_json.log: json; session 1 checkpoints at update 500 (--save-interval-updates 500),
  dies at update 700 with a CUDA error; session 2 loads checkpoint_last.pt (epoch 2 @ 500
  updates), redoes 501-700 and finishes at 1200.
"""
import io
import json
import logging
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

EPOCH_UPDATES = 400
INTERVAL = 100
WPB = 26000.0
TOTAL_GB = 79.109
T0 = 1785000000  # simulated start (seconds since the epoch, UTC)

# the values tests/test_compare.py checks
SPEC = {
    "baseline": dict(arch="transformer_wmt_en_de_big_t2t", ups=4.0, warm_ups=2.0, used_gb=35.2,
                     valid_s=20, save_s=10, loss0=10.0, bleu=(26.9, 27.61, 27.45)),
    "ls": dict(arch="ls_transformer_wmt_en_de_big_t2t", ups=10.0, warm_ups=2.5, used_gb=22.4,
               valid_s=12, save_s=10, loss0=10.0, bleu=(26.8, 27.53, 27.40)),
}


class Clock:
    def __init__(self, t):
        self.t = t


class SimFormatter(logging.Formatter):
    def __init__(self, clock):
        super().__init__("%(asctime)s | %(levelname)s | %(name)s | %(message)s", "%Y-%m-%d %H:%M:%S")
        self.clock = clock

    def formatTime(self, record, datefmt=None):
        return time.strftime(datefmt, time.gmtime(self.clock.t))


def loss_at(u, loss0):
    # smooth decay to ~4.0 (label-smoothed loss, base 2), rounded like fairseq's meters
    return round(4.0 + (loss0 - 4.0) * (0.5 ** (u / 250.0)), 3)


class Sim:
    """Drives fairseq's real loggers/progress bars with a simulated clock and made-up stats."""

    def __init__(self, spec, log_format, stream=None, log_file=None):
        from fairseq.logging import progress_bar as pb

        self.pb = pb
        self.spec = spec
        self.fmt = log_format
        self.clock = Clock(T0)
        self.log_file = log_file
        self.handlers = []
        root = logging.getLogger()
        self._saved = (root.handlers[:], root.level)
        root.handlers = []
        root.setLevel(logging.INFO)
        if stream is not None:
            h = logging.StreamHandler(stream)
            h.setFormatter(SimFormatter(self.clock))
            root.addHandler(h)
            self.handlers.append((root, h))
        if log_file is not None:
            # fairseq_cli/train.py: logger.addHandler(logging.FileHandler(filename=cfg.common.log_file))
            open(log_file, "w").close()
            h = logging.FileHandler(log_file)  # mode "a", like fairseq's: O_APPEND keeps the order
            logging.getLogger("fairseq_cli.train").addHandler(h)
            self.handlers.append((logging.getLogger("fairseq_cli.train"), h))
        self.wall_start = self.clock.t
        self.num_updates = 0
        self.best = None
        self.wpb_flip = 1
        self.epoch_stats = []

    def close(self):
        for lg, h in self.handlers:
            lg.removeHandler(h)
            h.close()
        pbl = logging.getLogger("fairseq.logging.progress_bar")
        for h in pbl.handlers[:]:
            pbl.removeHandler(h)
            h.close()
        root = logging.getLogger()
        root.handlers, lvl = self._saved
        root.setLevel(lvl)

    def info(self, name, msg):
        logging.getLogger(name).info(msg)

    def advance(self, seconds):
        self.clock.t += seconds

    def session_start(self, cfg_str, resumed=None, epoch=1):
        self.wall_start = self.clock.t
        self.info("fairseq_cli.train", cfg_str)
        self.advance(2)
        self.info("fairseq_cli.train", "task: TranslationTask")
        self.info("fairseq_cli.train", "model: TransformerModel")
        self.info("fairseq_cli.train", "criterion: LabelSmoothedCrossEntropyCriterion")
        self.info("fairseq_cli.train", "num. shared model params: 209,911,808 (num. trained: 209,911,808)")
        self.advance(3)
        from fairseq.utils import CudaEnvironment

        env = CudaEnvironment.__new__(CudaEnvironment)
        env.name, env.major, env.minor, env.total_memory_in_GB = "NVIDIA H100 80GB HBM3", 9, 0, TOTAL_GB
        CudaEnvironment.pretty_print_cuda_env_list([env])
        self.info("fairseq_cli.train", "training on 1 devices (GPUs/TPUs)")
        self.info("fairseq_cli.train", "max tokens per device = 4096 and max sentences per device = None")
        self.info("fairseq.trainer", "Preparing to load checkpoint checkpoints/checkpoint_last.pt")
        if resumed is None:
            self.info("fairseq.trainer", "No existing checkpoint found checkpoints/checkpoint_last.pt")
        else:
            self.advance(4)
            self.info("fairseq.trainer", "Loaded checkpoint checkpoints/checkpoint_last.pt (epoch {} @ {} updates)"
                      .format(epoch, resumed))
            self.num_updates = resumed
        self.info("fairseq.trainer", "loading train data for epoch {}".format(epoch))
        self.advance(5)

    def _bar(self, epoch, prefix=None):
        kw = dict(log_format=self.fmt, log_interval=INTERVAL, epoch=epoch, prefix=prefix,
                  default_log_format="simple")
        if self.log_file is not None and prefix is None:
            kw["log_file"] = self.log_file  # fairseq_cli/train.py passes it to the train bar only
        return self.pb.progress_bar(range(EPOCH_UPDATES), **kw)

    def train_epoch(self, epoch, stop_at=None, first_interval_warm=False):
        """Train from the current update to the end of `epoch` (or to `stop_at`)."""
        self.info("fairseq.trainer", "begin training epoch {}".format(epoch))
        self.info("fairseq_cli.train", "Start iterating over samples")
        bar = self._bar(epoch)
        bar.size = EPOCH_UPDATES
        end = epoch * EPOCH_UPDATES if stop_at is None else stop_at
        warm = first_interval_warm
        intervals = []
        while self.num_updates < end:
            self.num_updates += INTERVAL
            ups = self.spec["warm_ups"] if warm else self.spec["ups"]
            dt = INTERVAL / ups
            self.advance(dt)
            self.wpb_flip = -self.wpb_flip
            wpb = round(WPB * (1 + 0.01 * self.wpb_flip), 1)
            used = self.spec["used_gb"] + (0.3 if self.wpb_flip > 0 else -0.3)
            stats = dict(
                loss=loss_at(self.num_updates, self.spec["loss0"]),
                nll_loss=round(loss_at(self.num_updates, self.spec["loss0"]) - 0.35, 3),
            )
            stats["ppl"] = round(2 ** stats["nll_loss"], 2)
            stats.update(
                wps=round(ups * wpb, 1), ups=round(ups, 2), wpb=wpb, bsz=round(wpb / 29.5, 1),
                num_updates=self.num_updates, lr=round(5e-4 * min(1.0, self.num_updates / 4000.0), 9),
                gnorm=round(0.9 + 1.0 / (1 + self.num_updates / 100.0), 3), loss_scale=64,
                train_wall=round(dt), gb_free=round(TOTAL_GB - used, 1),
                wall=round(self.clock.t - self.wall_start),
            )
            intervals.append(stats)
            bar.i = self.num_updates - (epoch - 1) * EPOCH_UPDATES - 1
            bar.log(stats, tag="train_inner", step=self.num_updates)
            warm = False
        return bar, intervals

    def validate(self, epoch):
        self.info("fairseq_cli.train", 'begin validation on "valid" subset')
        self.advance(self.spec["valid_s"])
        bar = self._bar(epoch, prefix="valid on 'valid' subset")
        loss = round(loss_at(self.num_updates, self.spec["loss0"]) - 0.1, 3)
        stats = dict(loss=loss, nll_loss=round(loss - 0.4, 3))
        stats["ppl"] = round(2 ** stats["nll_loss"], 2)
        stats.update(wps=412345.6, wpb=2991.8, bsz=98.4, num_updates=self.num_updates)
        if self.best is not None:  # fairseq adds best_loss from the second validation on
            stats["best_loss"] = min(self.best, loss)
        self.best = loss if self.best is None else min(self.best, loss)
        bar.print(stats, tag="valid", step=self.num_updates)
        return loss

    def save(self, epoch, name, score):
        self.info("fairseq.checkpoint_utils", "Preparing to save checkpoint for epoch {} @ {} updates"
                  .format(epoch, self.num_updates))
        self.info("fairseq.trainer", "Saving checkpoint to /data/ckpt/{}".format(name))
        self.advance(self.spec["save_s"])
        self.info("fairseq.trainer", "Finished saving checkpoint to /data/ckpt/{}".format(name))
        self.info("fairseq.checkpoint_utils",
                  "Saved checkpoint checkpoints/{} (epoch {} @ {} updates, score {}) (writing took 9.87 seconds)"
                  .format(name, epoch, self.num_updates, score))

    def end_epoch(self, bar, epoch, intervals, train_wall):
        self.info("fairseq_cli.train", "end of epoch {} (average epoch stats below)".format(epoch))
        n = len(intervals)
        stats = dict(
            loss=round(sum(s["loss"] for s in intervals) / n, 3),
            nll_loss=round(sum(s["nll_loss"] for s in intervals) / n, 3),
        )
        stats["ppl"] = round(2 ** stats["nll_loss"], 2)
        stats.update(
            wps=round(sum(s["wps"] for s in intervals) / n, 1), ups=round(sum(s["ups"] for s in intervals) / n, 2),
            wpb=WPB, bsz=881.4, num_updates=self.num_updates, lr=intervals[-1]["lr"], gnorm=intervals[-1]["gnorm"],
            loss_scale=64, train_wall=round(train_wall), gb_free=min(s["gb_free"] for s in intervals),
            wall=round(self.clock.t - self.wall_start),
        )
        bar.print(stats, tag="train", step=self.num_updates)

    def full_epoch(self, epoch, last=False, warm=False, stop_reason=None):
        t = self.clock.t
        bar, intervals = self.train_epoch(epoch, first_interval_warm=warm)
        train_wall = self.clock.t - t
        if stop_reason:
            self.info("fairseq_cli.train", stop_reason)
        loss = self.validate(epoch)
        self.save(epoch, "checkpoint{}.pt".format(epoch) if not last else "checkpoint_best.pt", loss)
        self.end_epoch(bar, epoch, intervals, train_wall)
        return intervals


def cfg_string(arch, log_format, log_file=None, save_interval_updates=0):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    argv = ["data-bin/wmt14_en_de", "--arch", "transformer_wmt_en_de_big_t2t", "--share-all-embeddings",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0", "--lr", "5e-4",
            "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000", "--warmup-init-lr", "1e-07",
            "--dropout", "0.3", "--weight-decay", "0.0", "--criterion", "label_smoothed_cross_entropy",
            "--label-smoothing", "0.1", "--max-tokens", "4096", "--update-freq", "8", "--fp16",
            "--log-format", log_format, "--log-interval", str(INTERVAL), "--save-dir", "checkpoints",
            "--seed", "1", "--save-interval-updates", str(save_interval_updates)]
    if log_file:
        argv += ["--log-file", log_file]
    args = options.parse_args_and_arch(parser, argv)
    text = str(convert_namespace_to_omegaconf(args))
    if arch.startswith("ls_"):
        # the ls_ names, as the plugin run logs them (--user-dir registers them)
        text = (text.replace("'transformer_wmt_en_de_big_t2t'", "'" + arch + "'")
                .replace("'label_smoothed_cross_entropy'", "'ls_label_smoothed_cross_entropy'")
                .replace("'_name': 'adam'", "'_name': 'ls_adam'").replace("optimizer='adam'", "optimizer='ls_adam'")
                .replace("'user_dir': None", "'user_dir': '/opt/ls_fairseq/ls_fairseq'")
                .replace("user_dir=None", "user_dir='/opt/ls_fairseq/ls_fairseq'"))
    return text


def write_eval(run_dir, bleu):
    sacre, compound, gen = bleu
    os.makedirs(os.path.join(run_dir, "eval"), exist_ok=True)
    with open(os.path.join(run_dir, "eval", "sacrebleu.json"), "w") as f:
        json.dump({"name": "BLEU", "score": sacre,
                   "signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
                   "verbose_score": "58.6/32.5/20.4/13.4 (BP = 1.000 ratio = 1.003 hyp_len = 63012 ref_len = 62830)",
                   "nrefs": "1", "case": "mixed", "eff": "no", "tok": "13a", "smooth": "exp", "version": "2.6.0"},
                  f, indent=1, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(run_dir, "eval", "compound_split_bleu.txt"), "w") as f:
        f.write("Namespace(sys='eval/generate-test.txt.sys', ref='eval/generate-test.txt.ref', order=4, "
                "ignore_case=False, sacrebleu=False, sentence_bleu=False)\n")
        f.write("BLEU4 = {:.2f}, 59.2/33.3/21.2/14.0 (BP=1.000, ratio=1.004, syslen=67542, reflen=67262)\n"
                .format(compound))
    with open(os.path.join(run_dir, "eval", "generate-test.txt"), "w") as f:
        f.write("S-2\tGut@@ ach : Mehr Sicherheit für Fußgänger\n")  # not real output: format only
        f.write("T-2\tGutach : Increased safety for pedestrians\n")
        f.write("H-2\t-0.4071\tGutach : Mehr Sicherheit für Fußgänger\n")
        f.write("D-2\t-0.4071\tGutach : Mehr Sicherheit für Fußgänger\n")
        f.write("P-2\t-0.9 -0.1 -0.2 -0.3 -0.2 -0.1 -0.5 -0.4\n")
        f.write("Generate test with beam=4: BLEU4 = {:.2f}, 58.9/33.0/20.9/13.8 (BP=1.000, ratio=1.005, "
                "syslen=65340, reflen=65013)\n".format(gen))


def sample_full_run(name, log_format, subdir):
    spec = SPEC[name]
    run_dir = os.path.join(HERE, subdir)
    os.makedirs(run_dir, exist_ok=True)
    buf = io.StringIO()
    sim = Sim(spec, log_format, stream=buf)
    try:
        sim.session_start(cfg_string(spec["arch"], log_format))
        for epoch in (1, 2, 3):
            sim.full_epoch(epoch, warm=(epoch == 1), last=(epoch == 3),
                           stop_reason=("Stopping training due to num_updates: 1200 >= max_update: 1200"
                                        if epoch == 3 else None))
        sim.info("fairseq_cli.train", "done training in {:.1f} seconds".format(sim.clock.t - T0 - 10))
    finally:
        sim.close()
    with open(os.path.join(run_dir, "train.log"), "w") as f:
        f.write(buf.getvalue())
    write_eval(run_dir, spec["bleu"])


def sample_logfile():
    spec = SPEC["baseline"]
    run_dir = os.path.join(HERE, "logfile_simple")
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "train.fairseq.log")
    sim = Sim(spec, "simple", stream=io.StringIO(), log_file=path)
    try:
        sim.session_start(cfg_string(spec["arch"], "simple", log_file=path))
        for epoch in (1, 2, 3):
            sim.full_epoch(epoch, warm=(epoch == 1), last=(epoch == 3))
        sim.info("fairseq_cli.train", "done training in {:.1f} seconds".format(sim.clock.t - T0 - 10))
    finally:
        sim.close()
    # the real file holds the absolute --log-file path in the config dump: make it relative
    with open(path) as f:
        text = f.read().replace(path, "checkpoints/train.fairseq.log")
    with open(path, "w") as f:
        f.write(text)


def sample_interrupted():
    spec = SPEC["baseline"]
    buf = io.StringIO()
    sim = Sim(spec, "simple", stream=buf)
    try:
        sim.session_start(cfg_string(spec["arch"], "simple"))
        sim.full_epoch(1, warm=True)
        sim.train_epoch(2, stop_at=700)
    finally:
        sim.close()
    with open(os.path.join(HERE, "interrupted_simple.log"), "w") as f:
        f.write(buf.getvalue())


def sample_restart():
    spec = SPEC["ls"]
    buf = io.StringIO()
    sim = Sim(spec, "json", stream=buf)
    try:
        sim.session_start(cfg_string(spec["arch"], "json", save_interval_updates=500))
        sim.full_epoch(1, warm=True)
        t = sim.clock.t
        bar, _ = sim.train_epoch(2, stop_at=500)
        sim.validate(2)
        sim.save(2, "checkpoint_2_500.pt", sim.best)
        bar, _ = sim.train_epoch(2, stop_at=700)
        del t, bar
    finally:
        sim.close()
    crash = [
        "Traceback (most recent call last):",
        '  File "/usr/local/bin/fairseq-train", line 8, in <module>',
        "    sys.exit(cli_main())",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
    ]
    buf.write("\n".join(crash) + "\n")
    # the job scheduler restarts it 10 minutes later from checkpoint_last.pt (= update 500)
    gap = 600
    sim2 = Sim(spec, "json", stream=buf)
    sim2.clock.t = sim.clock.t + gap
    sim2.best = sim.best
    try:
        sim2.session_start(cfg_string(spec["arch"], "json", save_interval_updates=500), resumed=500, epoch=2)
        t = sim2.clock.t
        bar, intervals = sim2.train_epoch(2, first_interval_warm=True)
        # fairseq restores the epoch meters from the checkpoint: the epoch line averages over the
        # intervals of both sessions; made up here from the new session's only
        train_wall = sim2.clock.t - t
        loss = sim2.validate(2)
        sim2.save(2, "checkpoint2.pt", loss)
        sim2.end_epoch(bar, 2, intervals, train_wall)
        sim2.full_epoch(3, last=True, stop_reason="Stopping training due to num_updates: 1200 >= max_update: 1200")
        sim2.info("fairseq_cli.train", "done training in {:.1f} seconds".format(sim2.clock.t - t))
    finally:
        sim2.close()
    with open(os.path.join(HERE, "restart_json.log"), "w") as f:
        f.write(buf.getvalue())


def main():
    # import fairseq before the simulated loggers are installed, so that its import-time chatter
    # ("Please install tensorboardX") does not end up in the samples
    import fairseq.dataclass.utils  # noqa: F401
    import fairseq.logging.progress_bar  # noqa: F401
    import fairseq.options  # noqa: F401
    import fairseq.utils  # noqa: F401

    sample_full_run("baseline", "simple", "baseline_simple")
    sample_full_run("ls", "json", "ls_json")
    sample_logfile()
    sample_interrupted()
    sample_restart()
    print("samples written to", HERE)


if __name__ == "__main__":
    sys.exit(main())
