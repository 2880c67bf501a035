"""Generated blocks in README.md and docs/*.md: what lies between `<!-- NAME -->` and `<!-- /NAME -->`
belongs to a tool."""

import re


def replace_block(text: str, name: str, block: str) -> str:
  """`text` with what lies between `<!-- NAME -->` and `<!-- /NAME -->` replaced by `block`."""
  start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
  pattern = re.compile(f"({re.escape(start)}\n).*?({re.escape(end)})", re.DOTALL)
  if not pattern.search(text):
    raise ValueError(f"no {start} ... {end} block to rewrite; put the two markers where the table belongs.")
  return pattern.sub(lambda match: match.group(1) + block + match.group(2), text, count=1)
