"""Every test runs on 8 simulated CPU devices, set before jax is first imported."""

import os
import subprocess
import tempfile

# The optimisation level trades a little CPU run time for much shorter compiles,
# which dominate tests of tiny models.
os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0"])
# Many tests compile the same tiny programs (the single-device reference, a layout's step, a
# restarted train.py): JAX's persistent cache compiles each once per run, for every xdist worker and
# every process a test starts, all of which inherit this environment from the first process to load
# this file. One folder per run, named by that process, so every run starts cold.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "meshlm-test-jax-cache", str(os.getpid())))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# No test reads the Hugging Face hub: a hub name is refused at once, not after the network's time-outs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
  assert jax.device_count() == 8, "tests expect 8 simulated devices; was jax imported before conftest?"


@pytest.fixture
def small_disk(tmp_path):
  """A 700 KiB tmpfs: room for the logs, not for a checkpoint of the tiny model (1.4 MiB)."""
  mount = tmp_path / "disk"
  mount.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(mount)], capture_output=True).returncode:
    pytest.skip("this machine does not let the tests mount a tmpfs")
  yield mount
  # Lazily: a run stopped by the full disk may still hold its TensorBoard file open in the traceback.
  subprocess.run(["umount", "--lazy", str(mount)], check=True)
