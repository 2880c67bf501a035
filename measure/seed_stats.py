"""Statistics over seeds: each cell's mean with its 95% confidence interval, and a cell compared with a baseline
cell run on the same seeds (measure/sweep.py's seeded tables).

A meshlm run is a bit-reproducible function of (config, seed), so the spread of a cell's runs is the spread the
seeds cause, and nothing else. Two cells run with the same seed share their initial weights and their data order,
so the comparison is paired: Student's t on the per-seed differences, which removes what the seed moves in both.
Student's t distribution is computed here (the regularised incomplete beta function by its continued fraction)
rather than taken from scipy, which meshlm does not otherwise need.
"""

import dataclasses
import math
import statistics

CONFIDENCE = 0.95
SIGNIFICANT = 0.05  # a difference is marked significant where its p-value is below this


def _incomplete_beta(a: float, b: float, x: float) -> float:
  """The regularised incomplete beta function I_x(a, b), by Lentz's evaluation of its continued fraction."""
  if x <= 0 or x >= 1:
    return 0.0 if x <= 0 else 1.0
  if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below its mean: use the symmetry there
    return 1 - _incomplete_beta(b, a, 1 - x)
  front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)) / a
  tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
  for i in range(400):
    m = i // 2
    if i == 0:
      term = 1.0
    elif i % 2:
      term = -((a + m) * (a + b + m) * x) / ((a + 2 * m) * (a + 2 * m + 1))
    else:
      term = (m * (b - m) * x) / ((a + 2 * m - 1) * (a + 2 * m))
    d = 1 + term * d
    d = 1 / (d if abs(d) > tiny else tiny)
    c = 1 + term / c
    c = c if abs(c) > tiny else tiny
    f *= c * d
    if abs(1 - c * d) < 1e-14:
      break
  return front * (f - 1)


def t_two_sided_p(t: float, df: int) -> float:
  """P(|T| >= |t|) for Student's t with `df` degrees of freedom."""
  return _incomplete_beta(df / 2, 0.5, df / (df + t * t))


def t_quantile(probability: float, df: int) -> float:
  """The t with P(T <= t) = `probability` (above one half), by bisection on the two-sided tail."""
  tail = 2 * (1 - probability)
  low, high = 0.0, 1.0
  while t_two_sided_p(high, df) > tail:
    high *= 2
  for _ in range(200):
    middle = (low + high) / 2
    low, high = (middle, high) if t_two_sided_p(middle, df) > tail else (low, middle)
  return (low + high) / 2


def half_width(sd: float, n: int) -> float:
  """The 95% confidence interval's half-width of a mean of `n` values with standard deviation `sd`."""
  return t_quantile(1 - (1 - CONFIDENCE) / 2, n - 1) * sd / math.sqrt(n)


@dataclasses.dataclass(frozen=True)
class Cell:
  """A cell's value over its seeds."""
  n: int
  mean: float
  sd: float
  half_width: float  # of the 95% confidence interval of the mean


def cell(values: list[float]) -> Cell:
  if len(values) < 2:
    raise ValueError(f"a confidence interval needs at least 2 seeds, got {len(values)}; give --seeds=2 or more.")
  sd = statistics.stdev(values)
  return Cell(len(values), statistics.mean(values), sd, half_width(sd, len(values)))


@dataclasses.dataclass(frozen=True)
class Comparison:
  """A cell against the baseline, seed by seed: the mean difference (cell - baseline), its interval, the paired
  t-test's two-sided p-value, and the seeds that would make an interval of this spread exclude zero."""
  difference: float
  half_width: float
  p: float
  seeds_needed: int | None  # None: the differences are all zero, or would need more than MAX_SEEDS

  @property
  def significant(self) -> bool:
    return self.p < SIGNIFICANT


MAX_SEEDS = 1000


def paired(values: list[float], baseline: list[float]) -> Comparison:
  """`values` against `baseline`, their i-th entries from the same seed."""
  if len(values) != len(baseline):
    raise ValueError(f"a paired comparison needs the same seeds on both sides, got {len(values)} and {len(baseline)}.")
  differences = [v - b for v, b in zip(values, baseline)]
  n, mean = len(differences), statistics.mean(differences)
  sd = statistics.stdev(differences)
  if sd == 0:  # every seed moved by the same amount: no spread to test against
    return Comparison(mean, 0.0, 0.0 if mean else 1.0, None if not mean else n)
  p = t_two_sided_p(mean / (sd / math.sqrt(n)), n - 1)
  needed = next((k for k in range(2, MAX_SEEDS + 1) if half_width(sd, k) < abs(mean)), None)
  return Comparison(mean, half_width(sd, n), p, needed)
