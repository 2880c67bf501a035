"""Generate text from a run's checkpoint, with a key/value cache, on any mesh.

  python sample.py --workdir runs/tiny --prompt "def " --max_tokens 100 --temperature 0.8 --top_k 40
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python sample.py --workdir runs/tiny --mesh data=2,tensor=4 --num_samples 4

The model, tokenizer and mesh come from the config saved with the checkpoint;
`--mesh` lays the weights out differently (any mesh the model divides over).
"""

import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (it holds checkpoints/).", required=True)
_STEP = flags.DEFINE_integer("step", -1, "The checkpoint step; -1 takes the newest.")
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue; default the run's sample_prompt.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 0, "Tokens to generate; 0 fills the model's context.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 decodes greedily.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0 keeps them all.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Continuations of the prompt, decoded as one batch.")
_MESH = flags.DEFINE_string("mesh", "", "Axis sizes like data=2,tensor=4 (others 1); default the run's mesh.")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  # Imported after flag parsing, like train.py: jax reads its flags when first imported.
  from parallel.mesh import mesh_sizes
  from run.saved_run import from_checkpoint
  from training.sample import encode_prompt, generate
  try:
    mesh = mesh_sizes(_MESH.value) if _MESH.value else None
    config, layout, params, tokenizer, step = from_checkpoint(_WORKDIR.value, _STEP.value, mesh)
    text = config.sample_prompt if _PROMPT.value is None else _PROMPT.value
    prompt = encode_prompt(tokenizer, text)
    num_tokens = _MAX_TOKENS.value or layout.model.max_len - len(prompt)
    samples = generate(layout, params, prompt, num_tokens=num_tokens, temperature=_TEMPERATURE.value,
                       top_k=_TOP_K.value, seed=_SEED.value, num_samples=_NUM_SAMPLES.value)
  except ValueError as error:
    sys.exit(f"error: {error}")
  for index, ids in enumerate(samples):
    if len(samples) > 1:
      print(f"--- sample {index + 1} (step {step})")
    print(text + tokenizer.decode(ids))


if __name__ == "__main__":
  app.run(main)
