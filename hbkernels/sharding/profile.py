"""Machine profiles: the constants of a model of the sparse step, measured on the machine
and ranks a job runs on (``hbkernels plan --calibrate``,
:func:`hbkernels.bench.calibrate.calibrate`), or assumed (:func:`assumed_profile`, the
planner's :data:`~hbkernels.sharding.plan.DEFAULT_COST`), and labelled as such.

Each constant is a :class:`Spread`: the median of its repeats and their 20th and 80th
percentiles.

* ``lookup_ns_per_id[(dim, layout)]``: ``embedding_bag``'s time per id of a large batch,
  less the fixed cost of a call;
* ``update_ns_per_id[(dim, layout)]``: the optimizer's ``fused_step``, the same way;
* ``call_us["lookup"]``, ``call_us["update"]``: that fixed cost, the time of a call on a
  bag of one id; ``call_us["collection"]``, ``call_us["collection_table"]``: a one-rank
  collection's step (forward and backward) of one id in one table, and each table more;
* ``collective_latency_us``: an ``allreduce`` of one float64;
* ``network_bytes_per_s``: an ``alltoallv``'s bytes sent to the other ranks per second.

``layout`` is one of :data:`hbkernels.bench.common.LAYOUTS`: Zipf ranks scattered over
the table, Zipf ranks packed at its start (``ranked``), uniform ids. A profile made at one rank has no
collective of its own to measure: its two collective constants are the assumed ones, and
``measured_collectives`` is False.
"""
import dataclasses
import json
import math

from .._files import write_json_atomic
from ..bench.common import LAYOUTS
from .plan import DEFAULT_COST

PROFILE_VERSION = 1
#: the fixed costs of ``call_us``
CALLS = ("lookup", "update", "collection", "collection_table")
MEASURED, ASSUMED = "measured", "assumed"


@dataclasses.dataclass(frozen=True)
class Spread:
    """A measured value: the median of its repeats and their 20th and 80th percentiles."""
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values):
        ordered = sorted(float(v) for v in values)
        if not ordered:
            raise ValueError("a spread needs at least one value")

        def at(q):  # linear interpolation between the nearest ranks, as numpy.percentile
            x = q * (len(ordered) - 1)
            i = int(math.floor(x))
            j = min(i + 1, len(ordered) - 1)
            return ordered[i] + (ordered[j] - ordered[i]) * (x - i)

        return cls(at(0.5), at(0.2), at(0.8))

    @classmethod
    def exactly(cls, value):
        return cls(float(value), float(value), float(value))

    def to_json(self):
        return [self.median, self.low, self.high]

    @classmethod
    def from_json(cls, d):
        median, low, high = (float(x) for x in d)
        return cls(median, low, high)


@dataclasses.dataclass(frozen=True)
class MachineProfile:
    """The constants of the module docstring, where they come from (``source``:
    ``"measured"`` or ``"assumed"``) and the machine they describe (``machine``: host,
    CPU, cores, device, ranks, communicator backend, date, hbkernels version)."""
    source: str
    machine: dict
    lookup_ns_per_id: dict
    update_ns_per_id: dict
    call_us: dict
    collective_latency_us: Spread
    network_bytes_per_s: Spread
    measured_collectives: bool

    def to_json(self):
        def per_key(d):
            return {f"{dim}/{layout}": s.to_json() for (dim, layout), s in sorted(d.items())}

        return {"version": PROFILE_VERSION, "source": self.source, "machine": dict(self.machine),
                "lookup_ns_per_id": per_key(self.lookup_ns_per_id),
                "update_ns_per_id": per_key(self.update_ns_per_id),
                "call_us": {k: s.to_json() for k, s in sorted(self.call_us.items())},
                "collective_latency_us": self.collective_latency_us.to_json(),
                "network_bytes_per_s": self.network_bytes_per_s.to_json(),
                "measured_collectives": self.measured_collectives}

    @classmethod
    def from_json(cls, d, where="profile"):
        """The profile of :meth:`to_json`'s dict; a ``ValueError`` naming ``where`` and
        the first field that is missing or malformed."""
        field = "version"
        try:
            if d["version"] != PROFILE_VERSION:
                raise ValueError(f"version {d['version']!r}, this hbkernels reads {PROFILE_VERSION}")
            field = "source"
            if d["source"] not in (MEASURED, ASSUMED):
                raise ValueError(f"{d['source']!r} is neither {MEASURED!r} nor {ASSUMED!r}")
            per_key = {}
            for field in ("lookup_ns_per_id", "update_ns_per_id"):
                per_key[field] = {_key(k): Spread.from_json(v) for k, v in d[field].items()}
            field = "call_us"
            call_us = {k: Spread.from_json(v) for k, v in d["call_us"].items()}
            field = "collective_latency_us"
            latency = Spread.from_json(d[field])
            field = "network_bytes_per_s"
            bandwidth = Spread.from_json(d[field])
            field = "machine"
            machine = dict(d[field])
            field = "measured_collectives"
            measured = bool(d[field])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{where}: field {field!r}: {error}") from None
        return cls(d["source"], machine, per_key["lookup_ns_per_id"], per_key["update_ns_per_id"],
                   call_us, latency, bandwidth, measured)

    def save(self, path):
        """Write the profile to ``path`` as JSON, atomically."""
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path):
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: not a profile (JSON: {error})") from None
        return cls.from_json(d, where=str(path))


def _key(text):
    dim, sep, layout = text.partition("/")
    if not sep or not dim.isdigit() or int(dim) < 1 or layout not in LAYOUTS:
        raise ValueError(f"key {text!r} is not DIM/LAYOUT (a width >= 1, a layout of {LAYOUTS})")
    return int(dim), layout


def assumed_profile(widths, itemsize=4):
    """The planner's :data:`~hbkernels.sharding.plan.DEFAULT_COST` as a profile for tables
    of ``widths``: a lookup reads a row and an update reads and writes one (its optimizer
    state left out) at the assumed memory bandwidth, a call costs nothing; ``source``
    ``"assumed"``."""
    bandwidth = DEFAULT_COST["memory_bytes_per_s"]
    lookup = {(d, lay): Spread.exactly(1e9 * d * itemsize / bandwidth) for d in widths for lay in LAYOUTS}
    update = {(d, lay): Spread.exactly(2e9 * d * itemsize / bandwidth) for d in widths for lay in LAYOUTS}
    return MachineProfile(ASSUMED, {}, lookup, update,
                          dict.fromkeys(CALLS, Spread.exactly(0.0)),
                          Spread.exactly(1e6 * DEFAULT_COST["collective_latency_s"]),
                          Spread.exactly(DEFAULT_COST["network_bytes_per_s"]), False)
