"""Machine profiles: the constants of a model of the sparse step, measured on the machine
and ranks a job runs on (``hbkernels plan --calibrate``,
:func:`hbkernels.bench.calibrate.calibrate`), or assumed (:func:`assumed_profile`, from
:data:`DEFAULT_COST`), and labelled as such.

Each constant is a :class:`Spread`: the median of its repeats and their 20th and 80th
percentiles.

* ``lookup_ns_per_id[(dim, layout)]``, ``lookup_ns_per_bag[(dim, layout)]``:
  ``embedding_bag``'s time per id and per bag of a large batch (a call on B bags of L ids
  costs about a fixed cost + B·per bag + B·L·per id);
* ``update_ns_per_id[(dim, layout)]``, ``update_ns_per_bag[(dim, layout)]``: the
  optimizer's ``fused_step``, the same way;
* ``unique_ns_per_id[layout]``: ``hbkernels.unique`` (with the inverse) per id of the
  batch of ids in bags;
* ``call_us["lookup"]``, ``call_us["update"]``: the fixed cost, the time of a call on a
  bag of one id;
* ``step_us[kind]``, ``table_us[kind]``: a collection's step (forward and backward) on
  the profile's ranks of one id in one table placed as ``kind`` (each of
  :data:`~hbkernels.types.FLAT_PLACEMENTS`; a placement over a node's ranks takes its
  one-node placement's, :data:`~hbkernels.types.NODE_PLACEMENTS`), and each table more:
  its own work around the kernels, its collectives' latency included;
* ``host_ns_per_id[kind]``, ``host_ns_per_bag[kind]``: a collection's own cost per id and
  per bag of a rank's batch beyond what the other constants predict of its step (its
  routing of ids, the order of its rows, its calls' costs that grow with a batch), its
  tables placed as ``kind``;
* ``collective_latency_us``: an ``alltoallv`` of one float32 to each rank;
* ``network_bytes_per_s``: an ``alltoallv``'s bytes sent to the other ranks per second
  (of a node's ranks, where the ranks span nodes);
* ``across_bytes_per_s``: a rank's bytes per second to ranks of other nodes, where that
  link differs (a cluster's network beside a node's links); None: ``network_bytes_per_s``;
* ``sources``: where each constant comes from, in words (field -> text), where the
  profile says so (a profile made of published figures and older measurements).

``layout`` is one of :data:`hbkernels.bench.common.LAYOUTS`: Zipf ranks scattered over
the table, Zipf ranks packed at its start (``ranked``), uniform ids. A profile made at one rank has no
collective of its own to measure: its two collective constants are the assumed ones, and
``measured_collectives`` is False.
"""
import dataclasses
import json
import math
import os

from .._files import write_json_atomic
from ..bench.common import LAYOUTS
from ..types import FLAT_PLACEMENTS, NODE_PLACEMENTS, PLACEMENTS
from . import h100

#: profiles shipped with hbkernels: name -> its JSON dict (:func:`as_profile` takes the name)
SHIPPED = {h100.NAME: h100.profile_json}

PROFILE_VERSION = 3
#: the versions :meth:`MachineProfile.from_json` reads (2: no ``across_bytes_per_s``, no ``sources``)
READABLE_VERSIONS = (2, 3)
#: the constants assumed where no profile is given: network and memory bandwidth, the
#: latency of a collective
DEFAULT_COST = {"network_bytes_per_s": 10e9, "memory_bytes_per_s": 50e9, "collective_latency_s": 50e-6}
#: the fixed costs of ``call_us``
CALLS = ("lookup", "update")
MEASURED, ASSUMED = "measured", "assumed"
#: the fields of a profile kept per ``(width, layout)``
PER_KEY = ("lookup_ns_per_id", "update_ns_per_id", "lookup_ns_per_bag", "update_ns_per_bag")
#: the fields of a profile kept per placement (:data:`~hbkernels.types.PLACEMENTS`)
PER_KIND = ("step_us", "table_us", "host_ns_per_id", "host_ns_per_bag")


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
    lookup_ns_per_bag: dict
    update_ns_per_bag: dict
    unique_ns_per_id: dict
    call_us: dict
    step_us: dict
    table_us: dict
    host_ns_per_id: dict
    host_ns_per_bag: dict
    collective_latency_us: Spread
    network_bytes_per_s: Spread
    measured_collectives: bool
    across_bytes_per_s: Spread = None
    sources: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for field in PER_KIND:  # a placement over a node's ranks: as its one-node placement
            table = getattr(self, field)
            for kind, flat in NODE_PLACEMENTS.items():
                if kind not in table and flat in table:
                    table[kind] = table[flat]

    @property
    def across(self):
        """Bytes per second to ranks of other nodes (``across_bytes_per_s``, else the
        network's)."""
        return (self.across_bytes_per_s or self.network_bytes_per_s).median

    def to_json(self):
        def per_key(d):
            return {f"{dim}/{layout}": s.to_json() for (dim, layout), s in sorted(d.items())}

        return {"version": PROFILE_VERSION, "source": self.source, "machine": dict(self.machine),
                **{field: per_key(getattr(self, field)) for field in PER_KEY},
                "unique_ns_per_id": {lay: s.to_json() for lay, s in sorted(self.unique_ns_per_id.items())},
                **{field: {k: s.to_json() for k, s in sorted(getattr(self, field).items())}
                   for field in ("call_us",) + PER_KIND},
                "collective_latency_us": self.collective_latency_us.to_json(),
                "network_bytes_per_s": self.network_bytes_per_s.to_json(),
                "measured_collectives": self.measured_collectives,
                "across_bytes_per_s": (None if self.across_bytes_per_s is None
                                       else self.across_bytes_per_s.to_json()),
                "sources": dict(self.sources)}

    @classmethod
    def from_json(cls, d, where="profile"):
        """The profile of :meth:`to_json`'s dict; a ``ValueError`` naming ``where`` and
        the first field that is missing or malformed."""
        field = "version"
        try:
            if d["version"] not in READABLE_VERSIONS:
                raise ValueError(f"version {d['version']!r}, this hbkernels reads {READABLE_VERSIONS}")
            field = "source"
            if d["source"] not in (MEASURED, ASSUMED):
                raise ValueError(f"{d['source']!r} is neither {MEASURED!r} nor {ASSUMED!r}")
            per_key = {}
            for field in PER_KEY:
                per_key[field] = {_key(k): Spread.from_json(v) for k, v in d[field].items()}
                if set(per_key[field]) != set(per_key[PER_KEY[0]]):
                    raise ValueError(f"its widths and layouts are not those of {PER_KEY[0]!r}")
            field = "unique_ns_per_id"
            unique = {lay: Spread.from_json(v) for lay, v in d[field].items()}
            if set(unique) != {lay for _, lay in per_key[PER_KEY[0]]}:
                raise ValueError(f"its layouts are not those of {PER_KEY[0]!r}")
            field = "call_us"
            call_us = {k: Spread.from_json(v) for k, v in d["call_us"].items()}
            per_kind = {}
            for field in PER_KIND:
                per_kind[field] = {k: Spread.from_json(v) for k, v in d[field].items()}
                if not set(FLAT_PLACEMENTS) <= set(per_kind[field]) <= set(PLACEMENTS):
                    raise ValueError(f"it holds {sorted(per_kind[field])}, not each of "
                                     f"{FLAT_PLACEMENTS} (and at most {PLACEMENTS})")
            field = "collective_latency_us"
            latency = Spread.from_json(d[field])
            field = "network_bytes_per_s"
            bandwidth = Spread.from_json(d[field])
            field = "machine"
            machine = dict(d[field])
            field = "measured_collectives"
            measured = bool(d[field])
            field = "across_bytes_per_s"
            across = None if d.get(field) is None else Spread.from_json(d[field])
            field = "sources"
            sources = {str(k): str(v) for k, v in d.get(field, {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{where}: field {field!r}: {error}") from None
        return cls(d["source"], machine, **per_key, unique_ns_per_id=unique, call_us=call_us, **per_kind,
                   collective_latency_us=latency,
                   network_bytes_per_s=bandwidth, measured_collectives=measured,
                   across_bytes_per_s=across, sources=sources)

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


def as_profile(value, where="plan_profile"):
    """``value`` as a :class:`MachineProfile`: one already, the path of its JSON file, its
    JSON dict, or the name of a profile shipped with hbkernels (:data:`SHIPPED`); ``None``
    stays ``None``. A ``ValueError`` naming ``where`` otherwise."""
    if value is None or isinstance(value, MachineProfile):
        return value
    if isinstance(value, dict):
        return MachineProfile.from_json(value, where=where)
    if isinstance(value, str) and value in SHIPPED and not os.path.exists(value):
        return MachineProfile.from_json(SHIPPED[value](), where=value)
    if isinstance(value, (str, os.PathLike)):
        try:
            return MachineProfile.load(value)
        except OSError as error:
            raise ValueError(f"{where}: cannot read {value}: {error.strerror or error} (a profile's "
                             f"file, or one of {sorted(SHIPPED)})") from None
    raise ValueError(f"{where} must be a MachineProfile, the path of its JSON file, its dict or "
                     f"one of {sorted(SHIPPED)}, got {type(value).__name__}")


def assumed_profile(widths, itemsize=4):
    """:data:`DEFAULT_COST` as a profile for tables
    of ``widths``: a lookup reads a row and an update reads and writes one (its optimizer
    state left out) at the assumed memory bandwidth, a bag, a dedup, a call and a collection's step cost nothing;
    ``source`` ``"assumed"``."""
    bandwidth = DEFAULT_COST["memory_bytes_per_s"]
    lookup = {(d, lay): Spread.exactly(1e9 * d * itemsize / bandwidth) for d in widths for lay in LAYOUTS}
    update = {(d, lay): Spread.exactly(2e9 * d * itemsize / bandwidth) for d in widths for lay in LAYOUTS}
    free = {key: Spread.exactly(0.0) for key in lookup}
    return MachineProfile(ASSUMED, {}, lookup, update, free, dict(free),
                          {lay: Spread.exactly(0.0) for lay in LAYOUTS},
                          dict.fromkeys(CALLS, Spread.exactly(0.0)),
                          *({kind: Spread.exactly(0.0) for kind in PLACEMENTS} for _ in PER_KIND),
                          Spread.exactly(1e6 * DEFAULT_COST["collective_latency_s"]),
                          Spread.exactly(DEFAULT_COST["network_bytes_per_s"]), False)
