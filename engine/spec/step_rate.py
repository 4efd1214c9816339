"""Step seconds of plain and verify steps: what DSpark's admission (engine/spec/admission.py)
prices drafts with.

Model. A step of R decode rows plus P prefill tokens (base tokens B0 = R + P) that verifies D
draft tokens costs

    seconds(B0, D) = plain(B0) + extra_bucket(B0)(D)          (extra(0) = 0)

plain(B0) is the step without drafts; extra(D) is what scoring D drafts adds to it: the verify
kernels' larger batch, the per-position sampling and commit on the host, and on the GPU the
lost overlap (a verify step blocks, a plain one runs asynchronously). The two are different
paths, not one curve of B: the first draft costs a jump (SmolLM2 on the 2-core CPU box: 16
decode rows 51 ms, the same with one draft 58 ms), so extra(1) holds the jump and its growth
with D the per-draft cost. Where plain steps overlap the host (`overlapped_plain`: async
scheduling on the GPU), a verify step, which blocks, also costs what a blocking step costs over
an overlapped one: measured against the overlapped plain step, the engine's extras hold it; the
start-up extras (a blocking verify step against a blocking plain one) do not, and keys not
observed yet read them at the scale of the observed ones. (An earlier model added the profile's
blocking plain(B0) minus the measured one: an error in that start-up step then went into
every verify price, and the extras, floored at their start-up values, could not absorb it;
the load factor had been hiding it, see below.)
Keying extra by D (not by the tokens B0 + D of one curve) is what lets the steps the engine
runs re-measure the points its admission reads: a verify step at the running batch updates
extra(D) for that batch, where a curve of B would keep start-up values of another row layout (a
B of 96 profiled as 64 rows with one draft each, run as 16 rows with five). But extra(D) also
depends on the batch it joins (the 2-core CPU box: the first draft adds 5 ms to one decode row,
12 ms to 16), so there is one extra curve per batch bucket of B0 (`batch_bucket`: 1, 2, 3-5, 6-11,
12-22, ...): extras measured at batch 1 do not price drafts at batch 16. A bucket's
start-up values come from the profile of the nearest profiled row counts (the fewest rows that
hold the drafts, and the full batch), interpolated linearly in rows between them.

Each curve starts from the start-up profile (engine/spec/profile.py) and is re-measured online
from the engine's own step times (`observe`): per key the median of the last `window`
observations (robust to the odd step slowed by another process), the start-up value counting
as one observation until `window` real ones replaced it. A key not observed yet keeps the
profile's shape at the engine's scale: its start-up value times the median observed / start-up
ratio of its bucket's keys observed, once `SCALE_OBSERVATIONS` steps were, else the largest
of the other buckets' keys' ratios, once as many were (the scale is the device's, the
absolute times the batch's; on the H200 the engine's verify extra was several times the
profile's: priced at the profile's values, every verify key had to be run once before the
admission stopped choosing it). A verify step's observation of
extra(D) is its time minus plain(B0). Reads fit the medians with a weighted
non-decreasing least-squares fit (a bigger batch or more drafts is not cheaper: what says
otherwise is timing noise), except a plain key whose window holds the engine's steps alone,
which reads its own median (H100, SmolLM2: the fit pooled 16 rows, measured at 0.97 ms, with
the batches of 10-15 rows a chat batch's tail runs a few times, to 2.7 ms); they interpolate
linearly between keys (flat before the first, along the last segment's slope after the last);
extra(D) never reads below `EXTRA_FLOOR` of its start-up value. Real curves are step-shaped
(CUDA-graph buckets, tile sizes): measured points keep their own key, so the steps stay.

Load. On a shared machine every step slows down together when another process takes the cores,
but a key that is rarely run (a verify step, while nothing pays) keeps the times of the last
time it ran. So the curves hold times divided by a load factor, the geometric moving average
(weight `load_smoothing`) of observed / predicted over the steps at keys whose window holds only
this engine's steps (a start-up value, an exploration's first measurements or an interpolated
key can be off by far more than the load: those steps only fill their window); reads multiply
it back.
The admission compares step times with each other, so the factor cancels there; what it buys
is that a plain curve re-measured under today's load and an extra point measured under
yesterday's stay comparable. Where plain steps overlap the host the factor stays 1: the device
is the engine's own, and an overlapped plain step's time depends on whether the host or the
device bounds it at that batch, so a settled key's observed / predicted said nothing about the
others' and, with nothing anchoring its scale, the factor drifted (H100, SmolLM2, grounded
batch-1 and chat batch-16 traffic alternating ten times: plain(16) / plain(1) read 3.9 where
the steps measured 1.02).

Pure module: no torch import.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Mapping

# observations (at keys with a start-up value) before their observed / start-up ratio rescales
# the keys not observed yet: one step can be an outlier (SmolLM2 on CPU: the first verify step
# took 72 ms where later ones take 30, and scaled by it nothing was verified again)
SCALE_OBSERVATIONS = 3
# a verify step's extra never reads below this fraction of what the start-up profile timed for
# its drafts: on the 2-core CPU box a plain estimate biased up by a few ms (a slow window pooled
# by the monotone fit) made the extra of one or two drafts read 0, and such free drafts were
# admitted, and explored, at most steps of chat at batch 16 (0.93x of off); half still lets a
# profile slowed 2x by another process be re-measured down
EXTRA_FLOOR = 1.0


def median(values) -> float:
    """`statistics.median` of a few floats, without its type dispatch (the admission's tables
    take several medians a step; this one costs a sort)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if not ordered:
        raise ValueError("no median of no values")
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def nondecreasing(values: list[float], weights: list[float] | None = None) -> list[float]:
    """The weighted least-squares non-decreasing fit of `values` (pool adjacent violators)."""
    weights = weights or [1.0] * len(values)
    blocks: list[list[float]] = []   # [weighted sum, weight, count] per pooled block
    for value, weight in zip(values, weights):
        blocks.append([value * weight, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight_sum, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight_sum
            blocks[-1][2] += count
    return [total / weight for total, weight, count in blocks for _ in range(int(count))]


class _Curve:
    """Seconds by an integer key: a window of recent times per key, fitted on read."""

    def __init__(self, seconds: Mapping[int, float], window: int):
        self.window = window
        self._start = {int(k): float(s) for k, s in seconds.items()}   # start-up values
        self._start_keys = sorted(self._start)
        self._times: dict[int, deque[float]] = {
            k: deque([s], maxlen=window) for k, s in self._start.items()}
        self._measured: dict[int, int] = {}   # key -> steps observed there (not start-up)
        self._observed: dict[int, deque[float]] = {}   # key -> its observations alone
        # the medians of those windows, kept up to date by `observe` (one key changes a step)
        self._medians = dict(self._start)
        self._observed_medians: dict[int, float] = {}
        self._fitted: tuple[list[int], list[float]] | None = None
        self._fitted_ratio: float | None = None
        self._start_dense: list[float] = []

    def __bool__(self) -> bool:
        return bool(self._times)

    def observe(self, key: int, seconds: float) -> None:
        times = self._times.setdefault(key, deque(maxlen=self.window))
        times.append(seconds)
        observed = self._observed.setdefault(key, deque(maxlen=self.window))
        observed.append(seconds)
        self._medians[key] = median(times)
        self._observed_medians[key] = median(observed)
        self._measured[key] = self._measured.get(key, 0) + 1
        self._fitted = None

    def measured(self, key: int) -> int:
        return self._measured.get(key, 0)

    @property
    def start_keys(self) -> list[int]:
        """The keys with a start-up value, ascending."""
        return self._start_keys

    def start(self, key: int) -> float:
        """The start-up value at `key` (interpolated, flat outside; 0.0 without start-up
        values)."""
        if not self._start:
            return 0.0
        keys = self._start_keys
        return _interpolated(keys, [self._start[k] for k in keys], key, key, extend=False)[0]

    def ratios(self, *, interpolated: bool = False) -> list[tuple[int, float]]:
        """(observations, median observed / start-up) of each observed key with a start-up
        value (interpolated: also keys between start-up keys, read off the interpolation)."""
        starts = {k: self.start(k) if interpolated else self._start.get(k, 0.0)
                  for k in self._observed}
        return [(len(self._observed[k]), self._observed_medians[k] / starts[k])
                for k in self._observed if starts[k] > 0.0]

    def fitted(self, fallback_ratio: float | None = None) -> tuple[list[int], list[float]]:
        """(keys, fitted seconds): window medians, the start-up values in them read at the
        engine's scale: times the median over observed keys of observed / start-up (the
        profile's shape at the engine's scale) once SCALE_OBSERVATIONS steps were observed at
        such keys, else times `fallback_ratio` (None: 1); then the non-decreasing fit. A key
        never observed is its scaled start-up value; one observed fewer than `window` times
        the median of its observations and its scaled start-up value (with the profile's
        own scale there, where plain steps overlap the host, a batch size the engine ran
        once read the mean of a blocking start-up step and an overlapped one, and the fit
        pooled the batches after it, observed in full, with that mean)."""
        if self._fitted is None or self._fitted_ratio != fallback_ratio:
            keys = sorted(self._times)
            medians = [self._medians[k] for k in keys]
            ratios = self.ratios()
            ratio = fallback_ratio
            if sum(n for n, _ in ratios) >= SCALE_OBSERVATIONS:
                ratio = median(r for _, r in ratios)
            if ratio is not None:
                medians = [self._scaled_median(k, m, ratio) for k, m in zip(keys, medians)]
            weights = [float(len(self._times[k])) for k in keys]
            self._fitted = keys, nondecreasing(medians, weights)
            self._fitted_ratio = fallback_ratio
        return self._fitted

    def _scaled_median(self, key: int, window_median: float, ratio: float) -> float:
        """`key`'s window median with its start-up value (while still in the window) times
        `ratio`."""
        observed = self._observed.get(key)
        if observed is None:
            return window_median * ratio
        if key not in self._start or self._measured[key] >= self.window:
            return window_median   # the start-up value has left the window
        return median([*observed, self._start[key] * ratio])

    def seconds(self, key: int, fallback_ratio: float | None = None) -> float:
        keys, values = self.fitted(fallback_ratio)
        return _interpolated(keys, values, key, key, extend=True)[0]

    def settled(self, key: int) -> float:
        """`key`'s own median once the engine's observations fill its window, else
        `seconds(key)`: a key the engine runs all the time reads what it measured, whatever
        the fit pooled it with."""
        observed = self._observed.get(key)
        if observed is not None and len(observed) >= self.window:
            return self._observed_medians[key]
        return self.seconds(key)

    def dense(self, first: int, count: int, fallback_ratio: float | None = None) -> list[float]:
        """[seconds(first), ..., seconds(count)] in one pass over the fitted keys (what
        `seconds` reads key by key; the admission reads every draft count up to the step's)."""
        keys, values = self.fitted(fallback_ratio)
        return _interpolated(keys, values, first, count, extend=True)

    def start_dense(self, count: int) -> list[float]:
        """[start(1), ..., start(count)] (flat outside the start-up keys); kept."""
        have = len(self._start_dense)
        if have < count:
            count = max(count, 2 * have)
            keys = self._start_keys
            self._start_dense += (_interpolated(keys, [self._start[k] for k in keys], have + 1,
                                                count, extend=False)
                                  if keys else [0.0] * (count - have))
        return self._start_dense


def _interpolated(keys: list[int], values: list[float], first: int, count: int, *,
                  extend: bool) -> list[float]:
    """Values at first..count of the piecewise-linear function through (keys, values): flat
    before the first key; after the last flat, or along the last segment's non-negative
    slope (extend)."""
    out, last = [], len(keys) - 1
    index = bisect.bisect_left(keys, first)
    slope = (max((values[-1] - values[-2]) / (keys[-1] - keys[-2]), 0.0)
             if extend and last >= 1 else 0.0)
    for key in range(first, count + 1):
        while index <= last and keys[index] < key:
            index += 1
        if index == 0 or index <= last and keys[index] == key:
            out.append(values[index])
        elif index > last:
            out.append(values[-1] + slope * (key - keys[-1]))
        else:
            low, high = keys[index - 1], keys[index]
            weight = (key - low) / (high - low)
            out.append(values[index - 1] * (1.0 - weight) + values[index] * weight)
    return out


def batch_bucket(base_tokens: int) -> int:
    """The verify extra's batch bucket of a step of `base_tokens` (B0) tokens without drafts:
    the power of two nearest B0 in log scale (1; 2; 3-5 -> 4; 6-11 -> 8; 12-22 -> 16; ...),
    so that a batch of 16 that lost a few finished requests keeps the extras of 16."""
    base_tokens = max(base_tokens, 1)
    low = 1 << (base_tokens.bit_length() - 1)
    return 2 * low if base_tokens * base_tokens >= 2 * low * low else low


class StepRateTable:
    """Args:
        plain_seconds: base tokens B0 -> seconds of one step without drafts (>= 1 entry).
        extra_seconds: drafted tokens D -> seconds a verify step adds to the plain step of its
            batch, profiled on the fewest rows that hold the drafts (>= 1 entry; negative
            values count as 0): the start-up extra of batch bucket 1.
        window: recent observations kept per key and curve (0: never re-measure).
        load_smoothing: weight of one step in the load factor's moving average, in [0, 1]
            (0: no load factor).
        batch_extra_seconds: decode rows R -> {D: seconds D drafts spread over R rows add to
            the plain step of R rows}: start-up extras of larger batches (buckets between two
            profiled row counts interpolate linearly in R; above the last, the last).
    """

    def __init__(self, plain_seconds: Mapping[int, float], extra_seconds: Mapping[int, float],
                 window: int = 8, load_smoothing: float = 0.5, *,
                 batch_extra_seconds: Mapping[int, Mapping[int, float]] | None = None):
        if not plain_seconds or not extra_seconds:
            raise ValueError("a step-rate table needs at least one plain and one verify point")
        if window < 0:
            raise ValueError(f"window={window} must be >= 0 (0: never re-measure)")
        if not 0.0 <= load_smoothing <= 1.0:
            raise ValueError(f"load_smoothing={load_smoothing} must be in [0, 1]")
        profiles = {1: extra_seconds, **(batch_extra_seconds or {})}
        if any(rows < 1 or not extra for rows, extra in profiles.items()):
            raise ValueError("batch_extra_seconds needs rows >= 1, each with >= 1 verify point")
        self.window = window
        self.load_smoothing = load_smoothing
        self.load = 1.0     # observed / start-up-scale step times, moving geometric average
        self._overlapped_plain = False
        self._plain = _Curve(plain_seconds, max(window, 1))
        # start-up extras by profiled rows; the engine's extras by batch bucket (made on use)
        self._profiles = sorted((int(rows), _Curve({d: max(s, 0.0) for d, s in extra.items()},
                                                   1)) for rows, extra in profiles.items())
        self._extras: dict[int, _Curve] = {}
        self._measured_plain: dict[int, deque[float]] = {}   # B0 -> plain seconds as measured
        self._pooled: dict[int, float | None] = {}   # bucket -> the other buckets' ratio
        # B0 -> its `step_seconds` reader, valid until the next observation (the admission,
        # the gate and the exploration budget of one step read the same prices)
        self._readers: dict[int, Callable[[int], float]] = {}

    @property
    def overlapped_plain(self) -> bool:
        """Plain steps overlap the host (async scheduling): set by the engine before its
        first step. The load factor then stays 1 (module docstring)."""
        return self._overlapped_plain

    @overlapped_plain.setter
    def overlapped_plain(self, value: bool) -> None:
        self._overlapped_plain = value
        if value:
            self.load = 1.0
        self._readers.clear()

    def _extra(self, base_tokens: int) -> _Curve:
        """The extra curve of B0's batch bucket; a new one starts from the profile of the
        nearest profiled rows (interpolated between two)."""
        bucket = batch_bucket(base_tokens)
        curve = self._extras.get(bucket)
        if curve is None:
            rows = [r for r, _ in self._profiles]
            index = bisect.bisect_left(rows, bucket)
            if index < len(rows) and rows[index] == bucket or index in (0, len(rows)):
                _, profile = self._profiles[min(index, len(rows) - 1)]
                start = {d: profile.start(d) for d in profile.start_keys}
            else:
                (low, below), (high, above) = self._profiles[index - 1], self._profiles[index]
                weight = (bucket - low) / (high - low)
                start = {d: below.start(d) * (1.0 - weight) + above.start(d) * weight
                         for d in set(below.start_keys) | set(above.start_keys)}
            curve = self._extras[bucket] = _Curve(start, max(self.window, 1))
        return curve

    def _fallback_ratio(self, bucket: int) -> float | None:
        """The largest observed / start-up ratio of the other buckets' keys observed more
        than once (once SCALE_OBSERVATIONS steps were observed there): a bucket not observed
        enough yet reads its start-up values at the scale the others showed (on the H200
        several times the profile's, at every batch), and at the dearest of those scales: a
        bucket never verified is priced high rather than low, since a price too high is
        corrected by the exploration's measurements at a bounded cost, one too low by steps
        that each lose (H100: chat at batch 16, its bucket priced at the median scale of the
        grounded batch-1 keys and its confidences learnt there, verified most of its steps
        at 0.52x of speculation off)."""
        if bucket not in self._pooled:
            ratios = [ratio for other, curve in self._extras.items() if other != bucket
                      for ratio in curve.ratios(interpolated=True)]
            ratio = None
            if sum(n for n, _ in ratios) >= SCALE_OBSERVATIONS:
                repeated = [r for n, r in ratios if n > 1]
                ratio = max(repeated) if repeated else median(r for _, r in ratios)
            self._pooled[bucket] = ratio
        return self._pooled[bucket]

    def _unloaded(self, base_tokens: int, num_drafts: int) -> float:
        plain = self._plain.settled(max(base_tokens, 1))
        if num_drafts <= 0:
            return plain
        return plain + self._extra_seconds(base_tokens, num_drafts)

    def _extra_seconds(self, base_tokens: int, num_drafts: int) -> float:
        """Unloaded extra(D) of D > 0 drafts at B0's batch bucket: the fitted curve, floored
        at EXTRA_FLOOR x the start-up value."""
        curve = self._extra(base_tokens)
        return max(curve.seconds(num_drafts, self._fallback_ratio(batch_bucket(base_tokens))),
                   EXTRA_FLOOR * curve.start(num_drafts), 0.0)

    def seconds(self, base_tokens: int, num_drafts: int = 0) -> float:
        """Seconds of a step of `base_tokens` tokens without drafts that verifies `num_drafts`
        draft tokens (0: a plain step), at the current load."""
        return self.load * self._unloaded(base_tokens, num_drafts)

    def step_seconds(self, base_tokens: int) -> Callable[[int], float]:
        """D -> seconds(base_tokens, D): the admission's view of one step's batch (the same
        reader, its prices memoised, until the next `observe`)."""
        reader = self._readers.get(base_tokens)
        if reader is None:
            reader = self._readers[base_tokens] = self._reader(base_tokens)
        return reader

    def _reader(self, base_tokens: int) -> Callable[[int], float]:
        plain, load = self._plain.settled(max(base_tokens, 1)), self.load
        curve = self._extra(base_tokens)   # `_extra_seconds` with its curve and ratio bound
        ratio = self._fallback_ratio(batch_bucket(base_tokens))
        prices: list[float] = [load * plain]   # D -> seconds, made for D up to the largest read

        def seconds(num_drafts: int) -> float:
            if num_drafts <= 0:
                return prices[0]
            have = len(prices)
            if num_drafts >= have:
                count = max(num_drafts, 2 * have)
                start = curve.start_dense(count)
                prices.extend(load * (plain + max(fitted, EXTRA_FLOOR * start[d - 1], 0.0))
                              for d, fitted in enumerate(curve.dense(have, count, ratio),
                                                         start=have))
            return prices[num_drafts]
        return seconds

    def observe(self, base_tokens: int, num_drafts: int, seconds: float) -> None:
        """Re-measure: one executed step (B0 tokens without its drafts, D drafts scored) took
        `seconds`. A plain step joins plain(B0)'s window, a verify step extra(D)'s (its time
        minus plain(B0))."""
        if self.window <= 0 or base_tokens <= 0 or seconds <= 0.0:
            return
        self._readers.clear()
        curve, key = ((self._extra(base_tokens), num_drafts) if num_drafts > 0
                      else (self._plain, base_tokens))
        if curve.measured(key) >= self.window and not self._overlapped_plain:
            # only settled keys move the load
            predicted = self._unloaded(base_tokens, num_drafts)
            self.load *= (seconds / (self.load * predicted)) ** self.load_smoothing
        if num_drafts == 0:
            self._measured_plain.setdefault(base_tokens, deque(maxlen=self.window)).append(
                seconds)
        unloaded = seconds / self.load
        if num_drafts > 0:
            unloaded = max(unloaded - self._plain.settled(base_tokens), 0.0)
        curve.observe(key, unloaded)
        if num_drafts > 0:
            self._pooled.clear()

    def measured_plain(self, base_tokens: int) -> float:
        """Seconds of a plain step of `base_tokens`: the median of the last `window` plain
        steps observed at that batch, as measured (no start-up value, no fit across batches,
        no load factor: what a verify step's realized gain and an exploration's cost are
        judged against), else `seconds(base_tokens)`. The curves hold times divided by the
        load factor of their moment, which moves with every settled step; read back at
        another moment's factor, a plain step of 1.1 ms could read twice that."""
        window = self._measured_plain.get(max(base_tokens, 1))
        return self.seconds(base_tokens) if not window else median(window)

    def measured(self, base_tokens: int, num_drafts: int = 0) -> int:
        """How many executed steps were observed at this key: plain(B0) when num_drafts is 0,
        else extra(num_drafts) of B0's batch bucket."""
        return (self._extra(base_tokens).measured(num_drafts) if num_drafts
                else self._plain.measured(base_tokens))

    def as_milliseconds(self) -> dict[str, dict[int, dict[int, float] | float]]:
        """{"plain": {B0: ms}, "extra": {batch bucket: {D: ms}}} of the keys held (fitted,
        unloaded; the extras of the buckets used so far, else of the profiled rows)."""
        def rounded(curve: _Curve, ratio: float | None = None) -> dict[int, float]:
            return {k: round(v * 1e3, 3) for k, v in zip(*curve.fitted(ratio))}
        extras = ({b: rounded(c, self._fallback_ratio(b)) for b, c in sorted(self._extras.items())}
                  or {rows: rounded(c) for rows, c in self._profiles})
        return {"plain": rounded(self._plain), "extra": extras}
