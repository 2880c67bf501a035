"""The --config flag of train.py and the tools: a config file and variant, then --config.<field> overrides."""

import re
import sys

from ml_collections import config_flags


def define_config_flag(default: str, help_text: str):
  """Defines --config (`default` when not given); a misspelt override ends the program in one line.

  ml_collections applies the `--config.<field>` overrides while defining the flag, and a misspelt field
  raises three chained tracebacks whose message holds the field and its nearest name.
  """
  try:
    return config_flags.DEFINE_config_file("config", default, help_text, lock_config=True)
  except (KeyError, AttributeError) as error:
    field = re.findall(r"\w+", str(error))[0]
    hint = re.search(r'Did you mean \W*"(\w+)', str(error))
    sys.exit(f"error: the config has no field {field!r}{f' (did you mean {hint.group(1)!r}?)' if hint else ''}; "
             "configs/base.py lists every field.")
