"""The training loop: data -> jitted steps -> metrics, evals, checkpoints -> a sample."""

from __future__ import annotations

import contextlib
import math
import pathlib
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from jaxformer.core.sharding import (batch_devices, batch_sharding, check_context_split,
                                     check_expert_split, initialize_distributed, make_mesh,
                                     per_device_bytes, place_batch, process_rows, resolve_rules)
from jaxformer.data import DataError, load_dataset
from jaxformer.data.random_positions import randomize_batch
from jaxformer.model.build import model_for
from jaxformer.model.config import ConfigError
from jaxformer.model.encoder_decoder import EncoderDecoder
from jaxformer.model.mtp import moe_rows
from jaxformer.model.transformer import flops_per_token
from jaxformer.moe.balancing import layer_records
from jaxformer.training import objectives, profiling, tracking
from jaxformer.training.adapter_checkpoint import keep_base, run_checkpointer
from jaxformer.training.checkpoint import Checkpointer, abstract_like
from jaxformer.training.config import RunConfig
from jaxformer.training.evaluation import evaluate, sample_text, val_text
from jaxformer.training.initial_weights import base_loader, load_initial
from jaxformer.training.lock import make_run_dir, run_dir_lock
from jaxformer.training.metrics import MetricsLog, peak_flops, plot_loss_curve
from jaxformer.training.optim import make_optimizer
from jaxformer.training.peers import watch_peers
from jaxformer.training.seq2seq import translation_text
from jaxformer.training.step import (init_state, make_eval_step, make_train_step, state_shardings,
                                     trained_part)


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps)."""


class _StopFlag:
    """Turns SIGTERM / SIGINT into a request to save and stop after the current step."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _progress(total, initial, enabled):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0)


def train(cfg: RunConfig, *, log=print) -> dict:
    """Train as `cfg` says; returns a summary (steps, final losses, paths).

    On several processes (cfg.distributed, or a detected launcher) every process runs this
    same function: each reads only its rows of each batch, checkpoints are written by all
    together, and process 0 alone writes metrics, the sample and the progress bar (and
    holds the run dir's lock: one run per run dir)."""
    d = cfg.distributed
    initialize_distributed(d.coordinator_address, d.num_processes, d.process_id,
                           d.cpu_collectives, d.heartbeat_s)
    lead = jax.process_index() == 0
    tracking.check(cfg.train, lead)  # train.wandb without the wandb package: now, not later
    if not lead:
        log = lambda *args, **kwargs: None  # noqa: E731 (process 0 speaks for the run)
    run_dir = pathlib.Path(cfg.train.run_dir)
    make_run_dir(run_dir)
    with run_dir_lock(run_dir, log=log) if lead else contextlib.nullcontext(), \
            contextlib.ExitStack() as cleanup:
        cleanup.enter_context(watch_peers(run_dir, d.heartbeat_s))  # a lost process: exit 3
        run = _Run(cfg, run_dir, lead, log, cleanup)
        stopped_early = run.steps()
        return run.finish(stopped_early)


def load_run_data(cfg: RunConfig, run_dir: pathlib.Path, lead: bool, log):
    """The run's data (its tokenizer saved in run_dir), and whether its validation split
    holds a batch to evaluate."""
    t = cfg.train
    data = load_dataset(cfg.data, run_dir=str(run_dir), vocab_size=cfg.model.vocab_size,
                        progress=lead, log=log)
    try:
        next(iter(data.eval_batches(batch_size=t.batch_size, seq_len=t.seq_len,
                                    max_batches=1, pack=cfg.data.pack)))
        return data, True
    except DataError as e:
        log(f"no evaluation: {e}")
        return data, False


class _Run:
    """One run's data, model, state and checkpoints, and the stages that use them."""

    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path, lead: bool, log, cleanup):
        self.cfg, self.run_dir, self.lead, self.log = cfg, run_dir, lead, log
        t, mcfg = cfg.train, cfg.model
        objectives.build(cfg)  # a bad objective (grpo's reward) refused before the data loads
        self.data, self.can_eval = load_run_data(cfg, run_dir, lead, log)
        objective = objectives.build(cfg, self.data.tokenizer)  # the step's hooks
        self.model = model = model_for(mcfg)  # the Transformer, or the EncoderDecoder
        tx, schedule = make_optimizer(cfg.optim, mcfg, t.steps)
        mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, context=cfg.mesh.context,
                         expert=cfg.mesh.expert)
        rules = resolve_rules(cfg.mesh.rules)
        split = batch_devices(mesh, rules) * cfg.optim.grad_accum
        if t.batch_size % split:
            raise ConfigError(f"train.batch_size={t.batch_size} must be a multiple of the devices "
                              f"the batch is split over (mesh.data x mesh.fsdp x mesh.expert) x "
                              f"optim.grad_accum = {split} (mesh {dict(mesh.shape)})")
        check_context_split(t.seq_len, mesh.shape["context"])
        check_expert_split(mcfg.moe.experts, mesh.shape["expert"])
        shardings = state_shardings(model, tx, mesh, rules)
        batch_sh = batch_sharding(mesh, rules)
        self.rows = process_rows(batch_sh, t.batch_size)
        self.place = lambda batch: place_batch(batch, batch_sh, t.batch_size)
        state = init_state(model, tx, t.seed, mesh=mesh, rules=rules, shardings=shardings)
        self.ckpt = run_checkpointer(  # adapter-sized for LoRA from train.init_from
            cfg, run_dir, load=base_loader(mcfg, shardings.params, mesh, rules),
            keep=cfg.checkpoint.keep, log=log, async_save=cfg.checkpoint.async_save)
        cleanup.callback(self.ckpt.close)  # completes the saves in flight, however we leave
        fresh, reference = self.ckpt.latest_step() is None, None
        if t.init_from and (fresh or objectives.needs_reference(cfg)):  # given weights
            initial = load_initial(t.init_from, mcfg, state.params, shardings.params, mesh,
                                   rules, log)
            if fresh:  # a new run from them; their sha256, for adapter-sized saves
                state = state.replace(params=initial)
                keep_base(self.ckpt, state.params)
            reference = objectives.reference_weights(cfg, initial)  # DPO's, or None
        self.state = resume(self.ckpt, state, cfg, log)
        if lead:  # after the resume check: a refused resume leaves the run's config.yaml
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        self.start = int(self.state.step)
        self.tokens_per_step = t.batch_size * t.seq_len
        self.flops_per_step = flops_per_token(mcfg, t.seq_len) * self.tokens_per_step
        self.peak, peak_source = peak_flops(mcfg.dtype)
        self.log_setup(mesh, peak_source)
        on = dict(mesh=mesh, rules=rules, objective=objective, reference=reference)
        self.rollouts = objectives.entry_of(cfg).rollout  # GRPO: step(state, step index)
        self.train_step = objective.rollout_step(model, self.data, reference, mesh, rules,
                                                 shardings) if self.rollouts else \
            make_train_step(model, tx, schedule, grad_accum=cfg.optim.grad_accum,
                            shardings=shardings, **on)
        self.eval_step = make_eval_step(model, param_shardings=shardings.params, **on)
        self.metrics = MetricsLog(run_dir, enabled=lead,
                                  tracker=tracking.start(cfg, run_dir, lead))  # W&B
        cleanup.callback(self.metrics.close)
        self.bar = _progress(t.steps, self.start, t.progress and lead)
        self.best = self.ckpt.best_val_loss()  # carried across resumes
        self.summary: dict = {"run_dir": str(run_dir), "start_step": self.start}
        self.window = {"t0": time.perf_counter(), "losses": []}

    def log_setup(self, mesh, peak_source):
        """What the run is about to do: data, model, sweep, mesh."""
        log, data, t, mcfg = self.log, self.data, self.cfg.train, self.cfg.model
        log(f"data: {data.source}; train {data.token_counts[0]:,} tokens, "
            f"val {data.token_counts[1]:,}")
        trained = sum(x.size for x in jax.tree.leaves(trained_part(self.state.params)[0]))
        total = sum(x.size for x in jax.tree.leaves(self.state.params))
        log(f"model: {total:,} params ({trained:,} trained); {t.steps} steps x "
            f"{self.tokens_per_step:,} tokens; peak {self.peak / 1e9:,.0f} GFLOP/s "
            f"({peak_source}); run dir {self.run_dir}")
        if len(mcfg.lora.members()) > 1:
            log(f"sweep: {len(mcfg.lora.members())} LoRA adapters side by side, one vmapped "
                "step (losses in this order): " + ", ".join(
                    f"rank {m.rank} seed {m.seed}" for m in mcfg.lora.members()))
        log(f"mesh: {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} "
            f"device(s), {jax.process_count()} process(es); params per device "
            f"{per_device_bytes(self.state.params) / 2**20:,.1f} MiB")

    def batch_at(self, step):
        t = self.cfg.train
        if self.rollouts:  # GRPO draws its own prompts (training/grpo_step.py)
            return step
        batch = self.data.train_batch(seed=t.seed, step=step, batch_size=t.batch_size,
                                      seq_len=t.seq_len, pack=self.cfg.data.pack, rows=self.rows)
        # train.random_positions (Ruoss et al.): positions drawn from [0, MAX), or none
        return self.place(randomize_batch(batch, t.random_positions, t.seed, step, self.rows))

    def steps(self) -> bool:
        """Train to train.steps, evaluating and saving on the way; True when stopped early
        by SIGTERM / Ctrl-C. A step's metrics are read once the next step is queued."""
        t, every = self.cfg.train, self.cfg.checkpoint.every
        with _StopFlag() as stop, profiling.StepTrace(t.profile, self.run_dir, start=self.start,
                                                      log=self.log) as trace:
            step, pending = self.start, None
            while step < t.steps and not stop.requested:
                trace.at(step, self.state)  # train.profile: starts or stops the trace
                # the steps before this one are done (or, with asynchronous dispatch, all
                # but the one in flight): the end of the window that `pending` closes
                dispatched = time.perf_counter()
                self.state, m = self.train_step(self.state, self.batch_at(step))
                step += 1
                if pending is not None:
                    self.record(*pending, end=dispatched)
                pending = (step, m)
                if self.can_eval and step % t.eval_every == 0 and step < t.steps:
                    eval_t0 = time.perf_counter()
                    ev = self.evaluate_and_keep_best(step)
                    self.log(f"step {step}: {val_text(ev)}")
                    self.window["t0"] += time.perf_counter() - eval_t0  # tokens/s: training
                if step % every == 0:
                    self.ckpt.save(step, self.state, self.cfg.model)
            trace.stop(self.state)
            if pending is not None:
                self.summary["final_loss"] = self.record(*pending, end=None)
            return stop.requested

    def evaluate_and_keep_best(self, step):
        """Validation loss now; a new best is saved under best/ with its loss. A non-finite
        one stops the run."""
        ev = evaluate(self.eval_step, self.state.params, None, None, self.cfg, self.place,
                      self.rows, data=self.data)
        self.metrics.write({"step": step, **ev})
        if not math.isfinite(ev["val_loss"]):
            raise TrainingStopped(
                f"the validation loss at step {step} is {ev['val_loss']}: the model has "
                f"diverged. Resume from a checkpoint from before it (in {self.run_dir}/"
                "checkpoints or best/) with a lower optim.lr")
        if ev["val_loss"] < self.best:
            self.best = ev["val_loss"]
            self.ckpt.save(step, self.state, self.cfg.model, val_loss=self.best, best=True)
        return ev

    def record(self, done_step, m, end):
        """Log step `done_step` from its (now finished) metrics; stop on too many skips.
        `end`: when the steps up to done_step were done, for tokens/s (None: now). On one
        CPU device dispatch is synchronous, so by the time step k is recorded step k + 1
        has run too: timing to `now` would count it in step k's window, and leave the
        last window a step short (it logged 1e8 tokens/s)."""
        t, window, bar = self.cfg.train, self.window, self.bar
        m = jax.device_get(m)  # a sweep's metrics are [S]: one per adapter
        end = time.perf_counter() if end is None else end
        window["losses"].append(np.asarray(m["loss"], np.float64))
        if int(np.max(m["consecutive_skips"])) >= self.cfg.optim.max_skips:
            self.ckpt.save(int(self.state.step), self.state, self.cfg.model)
            raise TrainingStopped(
                f"{int(np.max(m['consecutive_skips']))} consecutive steps had non-finite gradients "
                f"(up to step {done_step}); params are unchanged since the last good step and "
                f"saved in {self.run_dir}/checkpoints. Lower optim.lr or check the data.")
        if done_step % t.log_every == 0 or done_step == t.steps:
            n, elapsed = len(window["losses"]), end - window["t0"]
            tok_s = n * self.tokens_per_step / elapsed
            losses = np.mean(window["losses"], axis=0)
            rec = {"step": done_step, "loss": float(np.mean(losses)),
                   "lr": float(np.max(m["lr"])), "grad_norm": float(np.max(m["grad_norm"])),
                   "skipped": int(np.sum(m["skipped"])), "tokens_per_s": tok_s,
                   "mfu": self.flops_per_step * n / elapsed / self.peak}
            if losses.ndim:
                rec["losses"] = [float(x) for x in losses]
            rec.update(layer_records(moe_rows(self.cfg.model), m))  # this step's (moe_load/i)
            rec.update(objectives.step_records(self.cfg, m))  # DPO's rewards: this step's too
            self.metrics.write(rec)
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{tok_s:,.0f}")
            window.update(t0=end, losses=[])
        if bar is not None:
            bar.update(done_step - bar.n)
        return float(np.mean(m["loss"]))

    def finish(self, stopped_early: bool) -> dict:
        """The last save; then, unless stopped early, the final evaluation and a sample.
        (`train`'s exit stack completes the saves and closes the metrics.)"""
        cfg, log, summary = self.cfg, self.log, self.summary
        end_step = int(self.state.step)
        self.ckpt.save(end_step, self.state, cfg.model)  # a step saved already is left as is
        if self.bar is not None:
            self.bar.update(end_step - self.bar.n)
            self.bar.close()
        summary.update(step=end_step, stopped_early=stopped_early)
        if stopped_early:
            log(f"stopped at step {end_step}; checkpoint saved, resume with the same command")
        elif self.can_eval:
            ev = self.evaluate_and_keep_best(end_step)
            summary.update(ev)
            log(f"final: {val_text(ev)} at step {end_step}")
        if not stopped_early and cfg.train.sample_tokens and len(cfg.model.lora.members()) == 1 \
                and cfg.model.generates:  # an encoder generates nothing
            sample = translation_text if isinstance(self.model, EncoderDecoder) else sample_text
            text = sample(self.model, self.state.params, self.data.tokenizer, cfg)
            if text is None:
                log("no sample: train.sample_prompt is empty or fills model.max_seq_len")
            elif self.lead:
                (self.run_dir / "sample.txt").write_text(text)
                how = "greedy, of train.sample_prompt as a source" if sample is translation_text \
                    else f"temperature {cfg.train.sample_temperature}"
                log(f"--- sample ({how}) ---\n{text}\n---")
        if self.lead and (self.run_dir / "metrics.jsonl").exists():
            summary["plot"] = str(plot_loss_curve(self.run_dir))
        return summary


def resume(ckpt: Checkpointer, state, cfg: RunConfig, log):
    """The newest intact checkpoint's state when there is one (train.resume=auto), else
    `state`; damaged checkpoints set aside with a warning (training/checkpoint.py). Params
    not all finite stop the run: training on from them cannot recover."""
    latest, run_dir = ckpt.latest_step(), cfg.train.run_dir
    if latest is None:
        return state
    if cfg.train.resume == "never":
        raise ConfigError(f"{run_dir} already holds checkpoints (up to step {latest}); "
                          "continue it with train.resume=auto, or start over in a new "
                          "train.run_dir (nothing is deleted)")
    state = ckpt.restore(abstract_like(state), cfg.model, set_aside=True, settings=cfg.to_dict())
    step = int(state.step)
    finite = jax.jit(lambda p: jax.tree.map(lambda x: jnp.isfinite(x).all(), p))(state.params)
    bad = [jax.tree_util.keystr(path) for path, ok in
           jax.tree_util.tree_flatten_with_path(jax.device_get(finite))[0] if not ok]
    if bad:
        raise TrainingStopped(f"checkpoint {run_dir}/checkpoints/{step} holds non-finite "
                              f"params ({len(bad)} arrays, e.g. {bad[0]}); resume from an "
                              "earlier checkpoint or start a new train.run_dir")
    steps = cfg.train.steps  # a finished run, rerun, or train.steps set below its step:
    log(f"resumed from {run_dir}/checkpoints/{step}" + (f"; train.steps={steps} is not past "
        "it: nothing to train (the final evaluation only); raise train.steps to train on"
        if step >= steps else ""))
    return state
