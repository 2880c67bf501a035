"""parallel/jax_compat.py: every private JAX piece the tree uses is where the installed jax keeps it,
and a jax that moved one says so in one line."""

import re
import sys

import jax
import pytest

from helpers import ROOT
from parallel import jax_compat


@pytest.mark.parametrize("module, name", jax_compat.PIECES, ids=lambda part: part)
def test_every_private_piece_exists_in_the_installed_jax(module, name):
  jax_compat.private(module, name)  # on a jax that moved it: the one-line ImportError


def test_the_tested_version_is_the_pinned_one():
  pinned = re.search(r"^jax==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE).group(1)
  assert jax_compat.TESTED_JAX == pinned


def test_a_moved_name_fails_with_one_line_naming_the_jax_version(monkeypatch):
  monkeypatch.setattr(jax, "__version__", "0.12.0")
  monkeypatch.delattr("jax._src.distributed.global_state")
  with pytest.raises(ImportError) as moved:
    jax_compat.coordination_client()
  assert str(moved.value) == (
      "jax 0.12.0 moved jax._src.distributed.global_state, which parallel/jax_compat.py reads for the "
      "coordination service's client (key-value store, barriers, live processes); pin jax==0.11.2 "
      "(constraints.txt) or update parallel/jax_compat.py")


def test_a_moved_module_fails_the_same_way(monkeypatch):
  monkeypatch.setitem(sys.modules, "jax._src.interpreters.partial_eval", None)  # its import now fails
  with pytest.raises(ImportError, match=r"^jax \S+ moved jax\._src\.interpreters\.partial_eval\."
                                        r"partial_eval_jaxpr_nounits, which [^\n]*parallel/jax_compat\.py$"):
    jax_compat.partial_eval_jaxpr_nounits(None, [], instantiate=False)
