"""The training loop: plan the layout, build state, step, log, evaluate, sample."""

import time

import jax
import numpy as np
from tqdm import tqdm

from training import data, metrics
from training.dry_run import report
from training.sample import generate
from training.state import init_state, param_count, plan
from training.step import make_eval_step, make_train_step
from training.tokenizer import load_tokenizer


def train(config, dry_run: bool = False) -> dict:
  """Train per `config`; returns the last logged metrics (and the final eval loss, if any)."""
  layout = plan(config)  # refuses a bad mesh or model before anything compiles
  seq_len = layout.model.max_len
  train_split = data.open_split(config.data, "train", vocab_size=config.model.vocab_size)
  val_split = data.open_split(config.data, "val", vocab_size=config.model.vocab_size)
  if dry_run:
    text = report(layout, config)
    print(text)
    return {"report": text}

  state = init_state(layout, config.seed)
  train_step, eval_step = make_train_step(layout, config), make_eval_step(layout)
  flops_token = metrics.flops_per_token(layout.model, param_count(layout))
  peak = metrics.peak_flops_per_device(config.peak_tflops)
  writer = metrics.MetricsWriter(config.workdir)
  _log(f"training {param_count(layout):,} parameters on {layout.mesh.size} devices, "
       f"mesh {dict(layout.mesh.shape)}, writing to {config.workdir}")

  def evaluate(params) -> float:
    losses = [eval_step(params, data.global_batch(val_split, seed=config.seed, step=i,
                                                  batch_size=config.batch_size, seq_len=seq_len,
                                                  sharding=layout.batch_sharding))
              for i in range(config.eval_batches)]
    return float(np.mean(jax.device_get(losses)))

  last, pending, interval_start = {}, None, time.perf_counter()
  tokens_per_step = config.batch_size * seq_len
  batches = data.batches(train_split, seed=config.seed, start=0, stop=config.steps,
                         batch_size=config.batch_size, seq_len=seq_len,
                         sharding=layout.batch_sharding, depth=config.data.prefetch)
  with batches, tqdm(total=config.steps, disable=jax.process_index() != 0, leave=False) as bar:
    for step, batch in batches:
      state, pending = train_step(state, batch)  # metrics stay on device until a log step
      bar.update(1)
      done = step + 1
      if done % config.log_every == 0 or done == config.steps:
        fetched = jax.device_get(pending)
        elapsed = time.perf_counter() - interval_start
        steps_in_interval = done - last.get("step", 0)
        tokens_per_sec = steps_in_interval * tokens_per_step / elapsed
        last = {"step": done, "loss": float(fetched["loss"]), "lr": float(fetched["lr"]),
                "grad_norm": float(fetched["grad_norm"]), "tokens_per_sec": tokens_per_sec,
                "mfu": metrics.mfu(tokens_per_sec, flops_token, peak)}
        writer.write(done, {k: v for k, v in last.items() if k != "step"})
        bar.write(_format(last))
        interval_start = time.perf_counter()
      if config.eval_every and (done % config.eval_every == 0 or done == config.steps):
        last["eval_loss"] = evaluate(state["params"])
        writer.write(done, {"eval_loss": last["eval_loss"]})
        bar.write(f"step {done:6d}  eval loss {last['eval_loss']:.4f}")
  writer.close()
  if config.sample_tokens:
    _log("sample: " + _sample(layout, state["params"], config, train_split.tokenizer))
  return last


def _sample(layout, params, config, tokenizer_name: str) -> str:
  tokenizer = load_tokenizer(tokenizer_name)
  prompt = tokenizer.encode(config.sample_prompt)
  ids = generate(layout, params, prompt, num_tokens=config.sample_tokens, seed=config.seed)
  return repr(config.sample_prompt + tokenizer.decode(ids))


def _format(m: dict) -> str:
  mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f}%"
  return (f"step {m['step']:6d}  loss {m['loss']:.4f}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
          f"tokens/s {m['tokens_per_sec']:,.0f}  mfu {mfu}")


def _log(line: str) -> None:
  if jax.process_index() == 0:  # one console per run, however many hosts
    print(line, flush=True)
