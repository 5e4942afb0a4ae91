"""A memory-latency model of the CUDA ops on an H100, computed from ptxas and the SASS.

No GPU is needed. For each case of :data:`CASES` (a public op at one dtype, D, L and
optimizer) the model

1. runs the public op at a tiny size under Numba's simulator, in a child process
   with ``NUMBA_ENABLE_CUDASIM=1``, and records its kernel launches as
   ``conftest.py`` does (:func:`compile_kernels.record_launches`);
2. in a child process without the simulator, rebuilds each distinct recorded
   kernel once at the GPU's launch geometry (:func:`compile_kernels.rebuild`),
   compiles it for sm_90 (Numba, NVVM, ptxas through nvJitLink) and disassembles
   the cubin with ``nvdisasm``;
3. reads from ptxas the registers and shared memory, hence the resident blocks
   per SM, and from the SASS the loads one thread has in flight in the kernel's
   hot loop (:func:`analyse_sass`), hence the bytes in flight per SM and, by
   Little's law, the kernel's bandwidth;
4. adds up the op's phases (:func:`phases`) at the case's real size: each phase
   moves some bytes at its kernel's modelled bandwidth, or at an assumed
   fraction of copy bandwidth for a library call (CuPy/CUB sort, scan,
   element-wise passes).

Definitions (one CSV row per case, :data:`COLUMNS`):

* ``registers``, ``blocks_per_sm``, ``bytes_in_flight_per_sm``: of the case's
  main kernel. Blocks of ``threads`` (the launch bounds' threads when the kernel
  has them, else the recorded launch's block size where it is not the
  simulator's 32, else 256) per SM under the H100 limits of
  :func:`compile_kernels.blocks_per_sm`: 65536 registers allocated per warp in
  units of 256, 2048 threads, 32 blocks, 228 KB of shared memory.
  Bytes in flight per SM = resident warps x 32 lanes x the bytes one lane's loads
  have in flight in the hot loop.
* Hot loop: the innermost loop (natural loop of the control-flow graph of the
  kernel's SASS, found from its backward branches) with the most global loads
  (``LDG``, generic ``LD``); the whole kernel when it has no loop. Loads in
  flight: the loop's instructions are scanned in address order from the loop
  head; each load's destination registers are tracked (a ``.64`` load writes 2
  registers, ``.128`` 4, a narrower one 1) until the first instruction that
  reads one of them (any source operand, ``.reuse`` or not, a ``.64`` address
  reading a register pair; a register overwritten before it is read stops being
  tracked). The loads issued before that instruction are in flight together;
  their widths (``.U8``/``.S8`` 1 byte, ``.U16``/``.S16`` 2, none 4, ``.64`` 8,
  ``.128`` 16) summed give the bytes per lane. A lane-uniform load (an id or a
  weight that every lane of a row group reads) counts at its full width for
  every lane.
* Modelled bandwidth of a kernel = min(:data:`COPY_BANDWIDTH`,
  bytes in flight per SM x :data:`SMS` / :data:`LATENCY`), the DRAM latency
  taken as 700 ns (:data:`LATENCY_RANGE` gives 600-800 ns; the report also gives
  the 800 ns figures). Library calls run at :data:`LIBRARY_EFFICIENCY` of copy.
* ``modelled_fraction_of_copy`` = counted bytes / modelled time / copy bandwidth,
  modelled time = the sum over the op's phases of bytes / the phase's bandwidth.
  Counted bytes follow ``bench/roofline-notes.md``: forward, every id's row plus
  ids, offsets and the output (a quantized forward: each id's codes, scale and bias,
  and a float32 output); lookup, rows read and written plus ids; backward +
  update, ``grad_out`` plus each touched row and its state read and written plus
  ids and offsets; the backward alone, ``grad_out`` plus the gradient rows and
  their ids written plus ids and offsets; unique, ids read, inverse and distinct
  ids written (``bench_unique``).
* ``max_serial_items_per_warp``: the most items one row group sums one after
  another: L for the forward, 1 for lookup and unique, and for the backward and
  ``fused_step`` :func:`hbkernels.cuda._segments.max_serial_items` of the real
  size's ids.

Real sizes (``hbkernels/bench/bench_roofline.py``'s GPU sizes): E = 1e7 rows, B = 65536 bags,
L = 32 (backward and fused: B x L = 2,097,152 ids), Zipf(1.05) ids of
``hbkernels.bench.common.zipf_ids`` with seed 0 (the benches' default), 2,097,152 ids for
lookup, 4M ids for unique. The distinct ids K and the work decomposition of the
backward are computed from those ids with NumPy.

Bytes a phase moves (what DRAM moves, not what the op counts): each array read or
written once per pass; an array of at most :data:`L2_BYTES` (``grad_out``, the
backward's sort keys) is read from DRAM once however often it is gathered; a
scattered access of 8 bytes or less into a larger array (unique's hash table, the
positions read at the heads of runs) moves a :data:`SECTOR`; CuPy's argsort is
:func:`sort_bytes`; the partial and final sums read what :func:`_segments.walks`
counts for the real ids.

The host's time per call, which the kernels' figures leave out (and which made the first H100
run's ops slower than their kernels, ``bench/results/h100-measured-2026-11-27.csv``): the case's
kernel launches and host synchronisations are counted under the simulator (the launcher's and
``_device``'s counters), its library calls are its phases without a kernel, and
``host time = (launches + library calls) x`` :data:`HOST_PER_LAUNCH` ``+ syncs x``
:data:`HOST_PER_SYNC`. An op that never waits is queued while the device runs the calls before
it, so its modelled time is the larger of its kernels' and its host's; one that waits pays both:
``modelled_op_fraction_of_copy`` is counted bytes / that time / copy bandwidth. Both constants are
modelled, not measured on a GPU (the CSV's columns name them).

Command line (``--report PATH``: a Markdown, or with ``.json`` a JSON, detail report)::

    python3 tests/kernel_model.py --write bench/results/h100-model.csv
    python3 tests/kernel_model.py --check bench/results/h100-model.csv   # exit 1 on regressions

Needs numba-cuda, the NVVM, NVRTC and nvJitLink libraries and ``nvdisasm`` (the
``test`` extra installs their wheels), not a GPU.
"""
import csv
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# -- H100 (SXM) constants --------------------------------------------------------------
ARCH = "sm_90"
SMS = 132
COPY_BANDWIDTH = 3.0e12  # bytes/s of a device-to-device copy, counted read + write
LATENCY = 700e-9  # s, DRAM latency used for the figures
LATENCY_RANGE = (600e-9, 800e-9)  # s; the report also gives the 800 ns figures
LANES = 32
DEFAULT_THREADS = 256  # threads per block when the launch does not say otherwise
SIMULATOR_THREADS = 32  # threads_per_block() under the simulator
LIBRARY_EFFICIENCY = 0.7  # fraction of copy bandwidth a CuPy/CUB call (sort, scan, element-wise) reaches
# host seconds per kernel launch or library call: the launcher's own Python is 3-7 us with a
# stub driver on the 2-core CPU runner (bench/results/amd-epyc-launch-path-2026-11-27.md), plus
# the driver's cuLaunchKernel and the op's front end; modelled, not measured on a GPU
HOST_PER_LAUNCH = 10e-6
HOST_PER_SYNC = 20e-6  # host seconds per wait for the device after its queue drains (modelled)
RADIX_BITS = 8  # key bits per pass of CUB's radix sort
SECTOR = 32  # bytes DRAM moves for a scattered access of 8 bytes or less
L2_BYTES = 50 * 2**20  # an array this small is read from DRAM once however often it is gathered

# -- real sizes (hbkernels/bench/bench_roofline.py, GPU) -----------------------------------------
E = 10**7
BAGS = 65536
ZIPF = 1.05
SEED = 0
LOOKUP_IDS = 65536 * 32
UNIQUE_IDS = 4 << 20
TABLE_IDS = 1 << 20  # hbkernels/bench/bench_hash_table.py
TABLE_CAPACITY = 1 << 22
TABLE_LOAD = 0.9

COLUMNS = ("op", "case", "registers", "blocks_per_sm", "bytes_in_flight_per_sm",
           "modelled_fraction_of_copy", "max_serial_items_per_warp", "launches", "host_syncs",
           "modelled_op_fraction_of_copy")
HIGHER_IS_BETTER = ("bytes_in_flight_per_sm", "blocks_per_sm", "modelled_fraction_of_copy",
                    "modelled_op_fraction_of_copy")
LOWER_IS_BETTER = ("max_serial_items_per_warp", "launches", "host_syncs")
TOLERANCE = 0.01  # relative: a figure may move this much the wrong way before it is a regression


# ======================================================================================
# SASS: instructions, loops, loads in flight
# ======================================================================================
@dataclass
class Instruction:
    address: int
    guard: str  # "@P0", "@!P1", or ""
    opcode: str  # with modifiers, e.g. "LDG.E.128"
    operands: list
    text: str
    target: str = None  # branch target label or address

    @property
    def base(self):
        return self.opcode.split(".")[0]


_LINE = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*([.\w$]+):\s*$")
_GUARD = re.compile(r"^(@!?U?P[0-7T])\s+")
_TARGET = re.compile(r"`\(([^)]+)\)")
_REGISTER = re.compile(r"\bR(\d+)((?:\.[A-Za-z0-9_]+)*)")
_LOAD_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "32": 4, "64": 8, "128": 16}
# opcodes with no register destination: every register operand is read
_NO_DESTINATION = ("ST", "STG", "STS", "STL", "RED", "REDG", "BRA", "BRX", "JMP", "JMX", "EXIT",
                   "RET", "CALL", "BSSY", "BSYNC", "WARPSYNC", "BAR", "MEMBAR", "NOP", "YIELD",
                   "DEPBAR", "ERRBAR", "CCTL", "FENCE", "BPT", "KILL", "NANOSLEEP")
_ENDS_BLOCK = ("EXIT", "RET", "BRX", "JMX", "KILL")


def parse_instruction(line):
    """The :class:`Instruction` of one nvdisasm line, or None for other lines."""
    m = _LINE.match(line)
    if not m:
        return None
    body = m.group(2).strip()
    guard = ""
    g = _GUARD.match(body)
    if g:
        guard, body = g.group(1), body[g.end():]
    opcode, _, rest = body.partition(" ")
    target = None
    t = _TARGET.search(rest)
    if t:
        target = t.group(1)
        rest = rest[:t.start()] + rest[t.end():]
    operands = [o.strip() for o in rest.split(",") if o.strip()]
    return Instruction(int(m.group(1), 16), guard, opcode, operands, m.group(2).strip(), target)


def parse_functions(sass):
    """``{function name: (instructions, {label: instruction index}), ...}`` of an nvdisasm
    listing, and the set of global (kernel entry) names."""
    functions, entries = {}, set()
    current = None
    pending = []
    for line in sass.splitlines():
        stripped = line.strip()
        if stripped.startswith(".global"):
            entries.add(stripped.split()[1])
            continue
        if stripped.startswith(".section") and ".text." in stripped:
            name = stripped.split(None, 1)[1].split(",")[0].strip().removeprefix(".text.")
            current = functions.setdefault(name, ([], {}))
            pending = []
            continue
        if current is None:
            continue
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        ins = parse_instruction(line)
        if ins is not None:
            for name in pending:
                current[1][name] = len(current[0])
            pending = []
            current[0].append(ins)
    return functions, entries


def load_width(ins):
    """Bytes one lane's global load ``ins`` reads (None: not a global load)."""
    if ins.base not in ("LDG", "LD"):
        return None
    width = 4
    for part in ins.opcode.split(".")[1:]:
        width = _LOAD_WIDTH.get(part, width)
    return width


def registers_read_written(ins):
    """``(registers read, registers written)`` by ``ins`` (sets of numbers; RZ excluded).
    The first operand is the destination unless the opcode has none (stores, branches,
    barriers); a ``.64`` operand is a register pair; a load writes as many registers as
    its width needs."""
    read, written = set(), set()
    operands = list(ins.operands)
    if ins.base not in _NO_DESTINATION and operands:
        dest = re.fullmatch(r"R(\d+)(?:\.[A-Za-z0-9_]+)*", operands[0])
        if dest is not None:
            first = int(dest.group(1))
            width = load_width(ins)
            written.update(range(first, first + (max(1, width // 4) if width else 1)))
            operands = operands[1:]
    for operand in operands:
        for number, suffix in _REGISTER.findall(operand):
            first = int(number)
            read.add(first)
            if ".64" in suffix:
                read.add(first + 1)
    return read, written


def basic_blocks(instructions, labels):
    """``(block starts, successors)``: the instruction index each block starts at, and
    for each block the blocks control may pass to."""
    n = len(instructions)
    leaders = {0} if n else set()
    for i, ins in enumerate(instructions):
        if ins.target is not None and ins.base == "BRA":
            if ins.target in labels:
                leaders.add(labels[ins.target])
            leaders.add(i + 1)
        elif ins.base in _ENDS_BLOCK:
            leaders.add(i + 1)
    starts = sorted(s for s in leaders if s < n)
    block_of = {}
    for b, s in enumerate(starts):
        end = starts[b + 1] if b + 1 < len(starts) else n
        for i in range(s, end):
            block_of[i] = b
    successors = []
    for b, s in enumerate(starts):
        end = (starts[b + 1] if b + 1 < len(starts) else n) - 1
        last = instructions[end]
        unconditional = not last.guard and not last.operands
        succ = set()
        if last.base == "BRA" and last.target in labels:
            succ.add(block_of[labels[last.target]])
            if not unconditional and end + 1 < n:
                succ.add(block_of[end + 1])
        elif last.base in ("EXIT", "RET", "KILL") and unconditional:
            pass
        elif end + 1 < n:
            succ.add(block_of[end + 1])
        successors.append(succ)
    return starts, successors


def natural_loops(starts, successors):
    """``{header block: set of blocks}`` of the natural loops (back edges u -> h where h
    dominates u), loops sharing a header merged."""
    count = len(starts)
    if not count:
        return {}
    preds = [set() for _ in range(count)]
    for b, succ in enumerate(successors):
        for s in succ:
            preds[s].add(b)
    everything = set(range(count))
    dom = [everything.copy() for _ in range(count)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in range(1, count):
            ps = [dom[p] for p in preds[b]]
            new = (set.intersection(*ps) if ps else set()) | {b}
            if new != dom[b]:
                dom[b], changed = new, True
    loops = {}
    for u, succ in enumerate(successors):
        for h in succ:
            if h in dom[u]:
                body = loops.setdefault(h, {h})
                stack = [u]
                while stack:
                    x = stack.pop()
                    if x not in body:
                        body.add(x)
                        stack.extend(preds[x])
    return loops


def loads_in_flight(ordered):
    """``(loads, first use)`` scanning ``ordered`` instructions: the global loads issued
    before the first instruction that reads a register one of them wrote (None: no such
    instruction)."""
    tracked = set()
    loads = []
    for ins in ordered:
        read, written = registers_read_written(ins)
        if read & tracked:
            return loads, ins
        width = load_width(ins)
        if width is not None:
            loads.append((ins, width))
            tracked |= written
        else:
            tracked -= written
    return loads, None


@dataclass
class LoopAnalysis:
    """The hot loop of a kernel and the loads a lane has in flight in it."""

    function: str
    loop_head: int = None  # address of the hot loop's head; None: no loop
    loop_instructions: int = 0
    loop_loads: int = 0
    loops: int = 0
    loads: list = field(default_factory=list)  # [(address, opcode, bytes)]
    first_use: str = None  # "address: instruction" of the first use, None: none in the loop
    innermost: list = field(default_factory=list)  # every innermost loop: [(head, loads, bytes in flight)]

    @property
    def loads_before_use(self):
        return len(self.loads)

    @property
    def bytes_per_lane(self):
        return sum(width for _, _, width in self.loads)

    def as_dict(self):
        return {"function": self.function, "loop_head": self.loop_head,
                "loop_instructions": self.loop_instructions, "loop_loads": self.loop_loads,
                "loops": self.loops, "loads": self.loads, "first_use": self.first_use,
                "innermost": self.innermost,
                "loads_before_use": self.loads_before_use, "bytes_per_lane": self.bytes_per_lane}


def analyse_function(name, instructions, labels):
    """:class:`LoopAnalysis` of one function's instructions."""
    starts, successors = basic_blocks(instructions, labels)
    loops = natural_loops(starts, successors)
    ends = starts[1:] + [len(instructions)]

    def block_range(b):
        return range(starts[b], ends[b])

    children = {h: {g for g in loops if g != h and g in body} for h, body in loops.items()}
    innermost = [h for h in loops if not children[h]]
    result = LoopAnalysis(name, loops=len(loops))

    def body(h):
        """The loop's instructions in address order, from its head round to its end."""
        idx = sorted(i for b in loops[h] for i in block_range(b))
        head = starts[h]
        return [instructions[i] for i in idx if i >= head] + [instructions[i] for i in idx if i < head]

    def weight(h):
        widths = [w for w in map(load_width, body(h)) if w is not None]
        return len(widths), sum(widths), -instructions[starts[h]].address

    for h in sorted(innermost, key=lambda h: starts[h]):
        loads, _ = loads_in_flight(body(h))
        result.innermost.append((f"{instructions[starts[h]].address:04x}", weight(h)[0],
                                 sum(width for _, width in loads)))
    if not innermost:
        ordered = instructions
    else:
        hot = max(innermost, key=weight)
        ordered = body(hot)
        result.loop_head = instructions[starts[hot]].address
        result.loop_instructions = len(ordered)
        result.loop_loads = weight(hot)[0]
    loads, first = loads_in_flight(ordered)
    result.loads = [(f"{ins.address:04x}", ins.opcode, width) for ins, width in loads]
    result.first_use = None if first is None else f"{first.address:04x}: {first.text}"
    return result


def analyse_sass(sass, function=None):
    """:class:`LoopAnalysis` of the kernel entry of an nvdisasm listing (or of
    ``function``; a listing with one function and no ``.global`` line: that one)."""
    functions, entries = parse_functions(sass)
    if function is None:
        names = [n for n in functions if n in entries] or list(functions)
        if len(names) != 1:
            raise ValueError(f"expected one kernel in the listing, found {names}")
        function = names[0]
    instructions, labels = functions[function]
    return analyse_function(function, instructions, labels)


# ======================================================================================
# the cases and their phases (edit here when the kernels change)
# ======================================================================================
@dataclass(frozen=True)
class Case:
    """One CSV row: ``op`` (the public op) and ``label`` name it; ``dtype``, ``dim`` (D),
    ``length`` (L), ``optimizer`` (a key of :data:`OPTIMIZERS`) and ``mode`` say what
    :func:`simulated_op` runs and :func:`phases` counts; ``main`` is the kernel
    (``module.name`` as in the launch records, without ``hbkernels.cuda.``) whose
    registers, blocks and bytes in flight the row reports."""

    op: str
    label: str
    main: str
    dtype: str = "float32"
    dim: int = 128
    length: int = 32
    optimizer: str = None
    mode: str = None  # hash_table: "find" or "insert"
    bits: int = 0  # quantized_bag: the codes' bits (output float32)

    @property
    def key(self):
        return f"{self.op},{self.label}"


OPTIMIZERS = {  # name in the case -> (hbk.optim class, per-element state arrays, per-row state arrays)
    "rowwise_adagrad": ("RowWiseAdagrad", 0, 1),
    "adagrad": ("Adagrad", 1, 0),
    "sgd": ("SGD", 0, 0),
    "adam": ("Adam", 2, 0),
}
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

CASES = [
    *[Case("embedding_bag", f"fp32 D={d} L=32", "embedding_bag.pool_kernel", dim=d)
      for d in (16, 64, 128, 256)],
    Case("embedding_bag", "fp16 D=128 L=32", "embedding_bag.pool_kernel", dtype="float16"),
    Case("embedding_bag", "bf16 D=128 L=32", "embedding_bag.pool_kernel", dtype="bfloat16"),
    Case("embedding_bag", "fp32 D=128 L=1", "embedding_bag.pool_kernel", length=1),
    Case("lookup", "fp32 D=128", "lookup.gather_kernel"),
    *[Case("quantized_bag", f"int{b} D=128 L=32", "quantized_bag.quantized_word_kernel", bits=b)
      for b in (8, 4)],
    Case("embedding_bag_backward", "fp32 D=128 zipf1.05", "embedding_bag_backward.gather_kernel"),
    *[Case("fused_step", f"{name} fp32 D=128 zipf1.05", "sparse_update._update_kernel",
           optimizer=name) for name in OPTIMIZERS],
    Case("unique", "int64 N=4M zipf1.05", "unique._insert", dtype="int64", dim=0, length=0),
    *[Case("hash_table", f"{mode} int64 N=1M capacity=2^22 load=0.9"
           + (" new=10%" if mode == "insert" else ""), "hash_table._find", dtype="int64", dim=0,
           length=0, mode=mode) for mode in ("find", "insert")],
]


@dataclass
class Phase:
    """Bytes one step of an op moves at the real size, at the bandwidth of ``kernel`` (a
    recorded kernel's ``module.name``) or, for a library call, ``LIBRARY_EFFICIENCY`` of
    copy bandwidth."""

    name: str
    bytes: float
    kernel: str = None


def phases(case, real):
    """THE PHASE TABLE: ``(counted bytes, [Phase, ...], max serial items per warp)`` of
    ``case`` at the real size (``real``: :class:`RealSizes`). Edit here when a kernel
    pipeline changes; every kernel a case launches must appear in one of its phases
    (``tests/test_kernel_model.py`` checks)."""
    item = np.dtype(case.dtype).itemsize if case.dtype != "bfloat16" else 2
    D = case.dim
    if case.op == "embedding_bag":
        n = BAGS * case.length
        ids, offsets, out = 8 * n, 8 * (BAGS + 1), BAGS * D * item
        counted = n * D * item + ids + offsets + out
        return counted, [Phase("pool", counted, "embedding_bag.pool_kernel")], case.length
    if case.op == "quantized_bag":  # a row of codes, scale and bias per id; float32 out
        n = BAGS * case.length
        row = -(-D * case.bits // 8) + 4
        counted = n * row + 8 * n + 8 * (BAGS + 1) + BAGS * D * 4
        return counted, [Phase("pool", counted, "quantized_bag.quantized_word_kernel")], case.length
    if case.op == "lookup":
        n = LOOKUP_IDS
        counted = 2 * n * D * item + 8 * n
        return counted, [Phase("gather rows", counted, "lookup.gather_kernel")], 1
    if case.op == "unique":
        n, k = UNIQUE_IDS, real.unique_distinct
        slots = 1 << max(1, (2 * n - 1).bit_length())  # hash table of 2^b >= 2N int64 keys
        counted = 16 * n + 8 * k
        return counted, [
            Phase("fill table, zero occupancy (CuPy)", 2 * 8 * (slots + 1)),
            # ids read, one probe each (a sector of a table larger than L2), a CAS per new
            # key, the slot of every id written
            Phase("insert", 8 * n + SECTOR * n + SECTOR * k + 8 * n, "unique._insert"),
            Phase("occupancy", 2 * 8 * slots, "unique._occupancy"),
            Phase("rank: zeros, cumsum, copy (CuPy)", 8 * slots + 2 * 8 * slots + 2 * 8 * slots),
            # rank read for every slot, the table at each occupied one, keys and slots written
            Phase("compact", 8 * slots + SECTOR * k + 16 * k, "unique._compact"),
            Phase("gather inverse", 8 * n + SECTOR * n + 8 * n, "unique._gather_inverse"),
        ], 1

    if case.op == "hash_table":
        return hash_table_phases(case.mode == "insert")

    # backward and fused_step: embedding_bag_backward.py, _segments.py, sparse_update.py;
    # unweighted sum: no coefficients; bounds checked: the keys need no fill
    n = BAGS * case.length
    k = real.distinct
    key = 4 if E < 2**31 else 8  # sort keys: int32 when the row ids fit
    index = 4  # bags, run numbers, run bounds: int32
    position = 8  # CuPy's argsort gives int64 positions
    acc = 4  # fp32 partial rows
    grad_out = BAGS * D * item
    grad_rows_gathered = 0 if grad_out <= L2_BYTES else D * item  # per item summed, past L2
    seg = real.segments
    ids, offsets = 8 * n, 8 * (BAGS + 1)
    common = [
        # ids and offsets read (and checked); per position the sort key and the bag written
        Phase("prepare", ids + offsets + n * (key + index), "embedding_bag_backward.prepare_kernel"),
        Phase("sort keys (CuPy argsort, CUB radix sort)", sort_bytes(n, key, position)),
        # each slot: the keys at and beside its window's edges, and its run's bounds by a
        # search inside the window (a position and a key a step, a sector each; only a
        # run's first and last windows search past their own: a few KB in all);
        # occurrences summed: position and bag (the rows of grad_out come from L2); partial
        # rows read and written
        Phase("partial rows (level by level)",
              seg.slots * 6 * SECTOR
              + (seg.direct - seg.direct_final) * (position + index + grad_rows_gathered)
              + (seg.partials_read - seg.partials_read_final) * D * acc
              + seg.partial_rows * D * acc,
              "embedding_bag_backward.partial_kernel"),
    ]
    # the final sums: grad_out once (it fits in L2), position and bag of the occurrences
    # summed directly, the partial rows of long runs, each run's bounds and key
    final_reads = (grad_out + seg.direct_final * (position + index + grad_rows_gathered)
                   + seg.partials_read_final * D * acc + k * (index + key))
    if case.op == "embedding_bag_backward":
        counted = grad_out + k * D * item + 8 * k + ids + offsets
        prepare, sort, partials = common
        return counted, [
            prepare, sort,
            # the runs (:mod:`hbkernels.cuda._runs`): per tile its heads counted, the counts
            # scanned (a few KB), then the runs' bounds: each launch reads the positions and
            # gathers the keys (they fit in L2); the last writes each head's start
            Phase("runs: heads per tile", n * (position + key), "_runs.run_kernels[0]"),
            Phase("runs: the tiles' counts scanned", 2 * index * -(-n // 2048),
                  "_runs.scan_kernels[1]"),
            Phase("runs: run bounds", n * (position + key) + k * index, "_runs.run_kernels[1]"),
            partials,
            # (final_reads holds each run's key; its id is written in the values' dtype)
            Phase("gather: sum each id's rows, write them and the ids",
                  final_reads + k * D * item + 8 * k, "embedding_bag_backward.gather_kernel"),
        ], seg.max_serial
    # fused_step
    _, element_states, row_states = OPTIMIZERS[case.optimizer]
    state = 2 * k * (element_states * D * acc + row_states * acc)  # read and written
    counted = grad_out + 2 * k * D * item + state + ids + offsets
    prepare, *rest = common  # the fused step's prepare also reads grad_out (its check)
    return counted, [
        Phase("prepare, check grad_out finite", prepare.bytes + grad_out, prepare.kernel),
        *rest,
        # every sorted position's position and key (is it a run's first?), then each run's
        # end by a galloping search (a sector per step: a few for most runs)
        Phase("update: find each run, sum its rows, apply the rule",
              final_reads + n * (position + key) + 4 * k * SECTOR + 2 * k * D * item + state,
              "sparse_update._update_kernel"),
    ], seg.max_serial


def probe_sectors(alpha, hit):
    """Mean sectors of 8-byte keys a linear probe reads at index load ``alpha``: Knuth's
    mean probe length ``L`` (``(1 + 1/(1-a))/2`` for a live id, ``(1 + 1/(1-a)^2)/2`` for an
    absent one), started at a uniform position within a sector: ``(L + 3) / 4``."""
    length = (1 + 1 / (1 - alpha) ** (1 if hit else 2)) / 2
    return (length + SECTOR // 8 - 1) / (SECTOR // 8)


def hash_table_phases(insert):
    """``HashTable.slots`` (hbkernels/hash_table.py) on :data:`TABLE_IDS` ids at
    :data:`TABLE_LOAD` of :data:`TABLE_CAPACITY` (index of ``2 x capacity`` positions),
    10% of the ids new when ``insert``. Counted: ids read, slots written."""
    n, alpha = TABLE_IDS, TABLE_LOAD * TABLE_CAPACITY / (2 * TABLE_CAPACITY)
    hit, miss = probe_sectors(alpha, True), probe_sectors(alpha, False)
    counted = 16 * n
    if not insert:
        # ids read, the key sectors of the probe, the slot's sector, the slot written
        return counted, [Phase("find", n * (16 + SECTOR * (hit + 1)), "hash_table._find")], 1
    m = n // 10  # new ids, all distinct
    h = n - m
    slots = 1 << max(1, (2 * m - 1).bit_length())  # unique's table for the misses
    return counted, [
        Phase("find", 16 * n + SECTOR * (h * (hit + 1) + m * miss), "hash_table._find"),
        Phase("misses: mask, any, compact (CuPy)", 8 * n + n + n + 9 * n + 8 * m),
        Phase("unique of the misses: fill, zero (CuPy)", 2 * 8 * (slots + 1)),
        Phase("unique: insert", 8 * m + 2 * SECTOR * m, "unique._insert"),
        Phase("unique: occupancy", 2 * 8 * slots, "unique._occupancy"),
        Phase("unique: rank (CuPy)", 5 * 8 * slots),
        Phase("unique: compact", 8 * slots + SECTOR * m + 16 * m, "unique._compact"),
        # every slot read; each hit's last and count read and written back (a sector each)
        Phase("touch", 8 * n + 4 * SECTOR * h, "hash_table._touch"),
        Phase("free slots to the device, concatenate (CuPy)", 24 * m),
        # id and slot read; the probe to a free position, its CAS and slot; the slot's
        # id, last and count written
        Phase("insert", m * (16 + SECTOR * (miss + 2 + 1 + 3)), "hash_table._insert"),
        Phase("find the new ids", m * (16 + SECTOR * (hit + 1)), "hash_table._find"),
        Phase("scatter their slots (CuPy)", n + 16 * m),
    ], 1


def sort_bytes(n, key_bytes, index_bytes=8):
    """Bytes CuPy's argsort of ``n`` keys moves: copy the keys, write the positions, read
    the keys once for CUB's histograms, then one CUB radix pass per ``RADIX_BITS`` key
    bits, each reading and writing keys and positions."""
    passes = -(-8 * key_bytes // RADIX_BITS)
    return n * (3 * key_bytes + index_bytes) + passes * 2 * n * (key_bytes + index_bytes)


def simulated_op(case):
    """A function running ``case``'s public op at a tiny size on Numba device arrays made
    beforehand (in the simulator child; the optimizer's state too, so that only the op's
    own launches are recorded). The forward runs 2 bags of up to 8 ids (the kernels do
    not depend on L), ``fused_step`` 2 bags of 16 ids, the backward 2 bags of 136 (more
    than the 256 sorted positions the simulator's blocks number in the sums' launch, so
    that it launches as at the real size), and the decomposition constant
    ``_segments.CHUNK`` is lowered to 4 (8 for the backward: two partial levels, as at
    the real size), so that the hottest id takes the path of the real size's hot ids
    (partial rows) without the simulator's slow shuffles over hundreds of items."""
    import hbkernels as hbk
    from numba import cuda

    from hbkernels.bench.common import float_dtype, zipf_ids

    rng = np.random.default_rng(0)

    def dev(a):
        return cuda.to_device(np.ascontiguousarray(a))

    rows = 64
    if case.op == "unique":
        ids = dev(zipf_ids(256, rows, ZIPF, seed=SEED))
        return lambda: hbk.unique(ids, return_inverse=True)
    if case.op == "hash_table":
        table = hbk.HashTable(rows, device="cuda")
        live = rng.integers(-2**63, 2**63 - 1, rows // 2, dtype=np.int64)
        table.slots(dev(live))
        batch = np.concatenate([rng.choice(live, 58), rng.integers(0, 2**62, 6)])
        ids = dev(batch)
        return lambda: table.slots(ids, insert=case.mode == "insert")
    dtype = float_dtype(case.dtype)
    table = dev(rng.uniform(-1, 1, (rows, case.dim)).astype(dtype))
    if case.op == "quantized_bag":
        q = hbk.quantize_rows(rng.uniform(-1, 1, (rows, case.dim)).astype(np.float32), case.bits)
        table = hbk.QuantizedTable.from_rows(dev(q.rows), case.bits, case.dim)
    if case.op == "lookup":
        ids = dev(rng.integers(0, rows, 64))
        return lambda: hbk.lookup(table, ids)
    forward = case.op in ("embedding_bag", "quantized_bag")
    bags, length = ((2, min(case.length, 8)) if forward else
                    (2, 136) if case.op == "embedding_bag_backward" else (2, 16))
    ids = dev(zipf_ids(bags * length, rows, ZIPF, seed=SEED))
    offsets = dev(np.arange(bags + 1, dtype=np.int64) * length)
    if forward:
        return lambda: hbk.embedding_bag(table, ids, offsets)
    try:
        from hbkernels.cuda import _segments

        if hasattr(_segments, "CHUNK"):
            _segments.CHUNK = 8 if case.op == "embedding_bag_backward" else 4
    except ImportError:
        pass
    grad = dev(rng.uniform(-1, 1, (bags, case.dim)).astype(dtype))
    if case.op == "embedding_bag_backward":
        return lambda: hbk.embedding_bag_backward(grad, ids, offsets, num_rows=rows)
    opt = getattr(hbk.optim, OPTIMIZERS[case.optimizer][0])(lr=0.01)
    state = opt.init_state(table)
    return lambda: opt.fused_step(table, state, grad, ids, offsets)


# ======================================================================================
# the real sizes' ids, with NumPy
# ======================================================================================
@dataclass
class Segments:
    """The backward's work decomposition of the real ids (:func:`_segments.walks`)."""

    max_serial: int
    direct: int = 0  # occurrences summed (final sums at level 0 and level-1 pieces)
    direct_final: int = 0  # of which by the final sums
    partials_read: int = 0  # partial rows summed (final sums above level 0, pieces above 1)
    partials_read_final: int = 0  # of which by the final sums
    partial_rows: int = 0  # partial rows written
    slots: int = 0  # window slots the partial kernels visit


@dataclass
class RealSizes:
    distinct: int  # K of the backward's B x L ids
    unique_distinct: int  # K of unique's 4M ids
    segments: Segments


def real_sizes():
    """:class:`RealSizes` from the benches' Zipf ids (NumPy, seed :data:`SEED`)."""
    sys.path.insert(0, str(REPO))
    from hbkernels.bench.common import zipf_ids

    keys = zipf_ids(BAGS * 32, E, ZIPF, seed=SEED)
    uniq = zipf_ids(UNIQUE_IDS, E, ZIPF, seed=SEED)
    return RealSizes(int(np.unique(keys).shape[0]), int(np.unique(uniq).shape[0]),
                     segments(keys))


def segments(keys):
    """:class:`Segments` of ``keys``: the runs of ``_segments.group`` and the sums that
    ``_segments.walks`` counts from them."""
    from hbkernels.cuda import _segments

    w = _segments.walks(keys)
    n, chunk = keys.shape[0], _segments.CHUNK
    levels = _segments.partial_levels(n, chunk)[0]
    return Segments(
        max_serial=w.longest,
        direct=int(w.final[0] + w.pieces[1]) if levels else int(w.final[0]),
        direct_final=int(w.final[0]),
        partials_read=int(w.final[1:].sum() + w.pieces[2:].sum()),
        partials_read_final=int(w.final[1:].sum()),
        partial_rows=int(w.rows.sum()),
        slots=sum(2 * -(-n // chunk**t) for t in range(1, levels + 1)))


# ======================================================================================
# step 1 (child, simulator): record each case's launches
# ======================================================================================
def record_cases(path):
    """Run every case under the simulator; save ``{"launches": {case key: {launch key:
    threads}}, "host": {case key: (kernel launches, host syncs)}}``, the host counts of a
    call after a first one (which takes the error ledger)."""
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
    sys.path[:0] = [str(HERE), str(REPO)]
    import compile_kernels

    import hbkernels as hbk
    from hbkernels.cuda import _device, _launcher

    compile_kernels.record_launches()
    sys.setswitchinterval(1e-3)  # the simulator's barriers pass the GIL around: 3-4x faster
    recorded, host = {}, {}
    for case in CASES:
        op = simulated_op(case)
        compile_kernels.LAUNCHES.clear()
        compile_kernels.BLOCK_THREADS.clear()
        op()
        recorded[case.key] = {key: sorted(compile_kernels.BLOCK_THREADS.get(key, ()))
                              for key in compile_kernels.LAUNCHES}
        hbk.synchronize()
        launches, syncs = _launcher.LAUNCHES[0], _device.HOST_SYNCS[0]
        op()
        host[case.key] = (_launcher.LAUNCHES[0] - launches, _device.HOST_SYNCS[0] - syncs)
        hbk.synchronize()
    with open(path, "wb") as f:
        pickle.dump({"launches": recorded, "host": host}, f)


# ======================================================================================
# step 2 (child, no simulator): compile and disassemble each distinct kernel once
# ======================================================================================
def find_nvdisasm():
    """Path of ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, or the PATH), or None."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("nvdisasm")
        if found:
            return str(found)
    except Exception:  # noqa: BLE001 - an old or missing cuda-pathfinder: try the PATH
        pass
    return shutil.which("nvdisasm")


def kernel_name(source):
    module, name, _, position = source
    return f"{module.removeprefix('hbkernels.cuda.')}.{name}" + (
        f"[{position}]" if position is not None else "")


def compile_cases(recorded_path, out_path, sass_dir=None):
    """Compile every distinct launch of the recording; write a JSON list, one entry per
    launch: kernel, factory arguments, threads per block, resources and the hot loop
    (and each kernel's SASS listing to ``sass_dir``, when given)."""
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "0", "run with NUMBA_ENABLE_CUDASIM=0"
    sys.path[:0] = [str(HERE), str(REPO)]
    import compile_kernels

    with open(recorded_path, "rb") as f:
        recorded = pickle.load(f)["launches"]
    cc = divmod(int(ARCH.removeprefix("sm_")), 10)
    compile_kernels._pretend_device(cc)
    nvdisasm = find_nvdisasm()
    launches = {}
    for case_key, keys in recorded.items():
        for key, threads in keys.items():
            launches.setdefault(key, {"cases": [], "threads": set()})
            launches[key]["cases"].append(case_key)
            launches[key]["threads"].update(threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for (source, argtypes), seen in launches.items():
            row = {"kernel": kernel_name(source), "factory_args": repr(source[2]),
                   "argtypes": [str(t) for t in argtypes], "cases": seen["cases"]}
            try:
                dispatcher, args = compile_kernels.rebuild(source)
                row["factory_args"] = repr(args)
                bounds = dispatcher.targetoptions.get("launch_bounds")
                simulated = sorted(seen["threads"])
                if bounds:
                    threads = int(bounds[0] if isinstance(bounds, (tuple, list)) else bounds)
                elif simulated and max(simulated) != SIMULATOR_THREADS:
                    threads = max(simulated)
                else:
                    threads = DEFAULT_THREADS
                resources, cubin = compile_kernels.compile_one(dispatcher, argtypes, cc, cubin=True)
                cubin_path = Path(tmp) / "kernel.cubin"
                cubin_path.write_bytes(cubin)
                sass = subprocess.run([nvdisasm, "-c", str(cubin_path)], capture_output=True,
                                      text=True, check=True).stdout
                if sass_dir:
                    row["sass"] = str(Path(sass_dir) / f"{len(rows):02d}-{row['kernel']}.sass")
                    Path(row["sass"]).write_text(sass)
                row.update(resources, threads=threads, launch_bounds=bounds,
                           loop=analyse_sass(sass).as_dict())
            except Exception as error:  # noqa: BLE001 - every failure goes in the report
                row["error"] = f"{type(error).__name__}: {error}"
            rows.append(row)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1, default=str)


# ======================================================================================
# step 3: the model
# ======================================================================================
def missing_tools():
    """What the model needs and this machine lacks (empty: nothing)."""
    missing = []
    import importlib.util

    if importlib.util.find_spec("numba") is None or importlib.util.find_spec("numba.cuda") is None:
        missing.append("numba-cuda")
    sys.path.insert(0, str(HERE))
    import compile_kernels

    if not compile_kernels.have_cuda_compilers():
        missing.append("the NVVM, NVRTC or nvJitLink library")
    if find_nvdisasm() is None:
        missing.append("nvdisasm")
    return missing


def kernel_figures(row):
    """Blocks, bytes in flight and modelled bandwidth of one compiled kernel row."""
    sys.path.insert(0, str(HERE))
    import compile_kernels

    blocks = compile_kernels.blocks_per_sm(row["registers"], row["shared_bytes"], row["threads"])
    warps = blocks * -(-row["threads"] // LANES)
    in_flight = warps * LANES * row["loop"]["bytes_per_lane"]
    return {"blocks_per_sm": blocks, "warps_per_sm": warps, "bytes_in_flight_per_sm": in_flight,
            "bandwidth": bandwidth(in_flight), "bandwidth_800ns": bandwidth(in_flight, 800e-9)}


def bandwidth(in_flight_per_sm, latency=LATENCY):
    """Little's law, capped at copy bandwidth (bytes/s). A kernel with no load in its hot
    loop only stores, which waits for nothing: copy bandwidth."""
    if in_flight_per_sm == 0:
        return COPY_BANDWIDTH
    return min(COPY_BANDWIDTH, in_flight_per_sm * SMS / latency)


def _run(args, env_sim, timeout):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM=env_sim,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), timeout


def _wait(proc_timeout, what):
    proc, timeout = proc_timeout
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{out[-6000:]}")


def compute(timeout=900, sass_dir=None):
    """Every case's figures: ``{"constants": ..., "cases": [detail, ...]}``; each detail
    has ``row`` (the CSV row), the phases with their bandwidths and times, the kernels
    and the 800 ns figures, or, for a case that could not be computed (a kernel of its
    phases not launched, or not compiling), ``error``. ``sass_dir``: also write each
    kernel's SASS listing there."""
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        recorded, compiled = Path(tmp) / "launches.pkl", Path(tmp) / "compiled.json"
        _wait(_run(["record-launches", str(recorded)], "1", timeout), "recording under the simulator")
        steps = {"record": time.time() - start}
        if sass_dir:
            Path(sass_dir).mkdir(parents=True, exist_ok=True)
        compiling = _run(["compile-launches", str(recorded), str(compiled),
                          *([str(Path(sass_dir).resolve())] if sass_dir else [])], "0", timeout)
        real = real_sizes()  # NumPy, while the child compiles
        steps["real_sizes"] = time.time() - start - steps["record"]
        _wait(compiling, "compiling the kernels")
        steps["compile"] = time.time() - start - steps["record"]
        rows = json.loads(compiled.read_text())
        with open(recorded, "rb") as f:
            host = pickle.load(f)["host"]
    kernels = {}  # case key -> kernel name -> [rows]
    for row in rows:
        for case_key in row["cases"]:
            kernels.setdefault(case_key, {}).setdefault(row["kernel"], []).append(row)
    details = []
    for case in CASES:
        try:
            details.append(model_case(case, kernels.get(case.key, {}), real, host[case.key]))
        except (LookupError, RuntimeError) as error:  # a kernel missing or not compiling
            details.append({"key": case.key, "error": str(error)})
    return {"constants": constants(), "real": {"distinct_ids": real.distinct,
                                               "unique_distinct_ids": real.unique_distinct,
                                               "segments": vars(real.segments)},
            "seconds": round(time.time() - start, 1),
            "step_seconds": {k: round(v, 1) for k, v in steps.items()}, "cases": details}


def constants():
    return {"arch": ARCH, "sms": SMS, "copy_bandwidth": COPY_BANDWIDTH, "latency": LATENCY,
            "latency_range": LATENCY_RANGE, "library_efficiency": LIBRARY_EFFICIENCY,
            "radix_bits": RADIX_BITS, "sector": SECTOR, "l2_bytes": L2_BYTES,
            "host_per_launch": HOST_PER_LAUNCH, "host_per_sync": HOST_PER_SYNC, "rows": E,
            "bags": BAGS, "zipf": ZIPF, "seed": SEED, "lookup_ids": LOOKUP_IDS,
            "unique_ids": UNIQUE_IDS}


def model_case(case, launched, real, host=(0, 0)):
    """The detail of one case from its launched kernels' compile rows and its host counts
    ``(kernel launches, host syncs)``."""
    def pick(name):
        rows = launched.get(name)
        if not rows:
            raise LookupError(f"{case.key}: the phase table names kernel {name}, which the op did "
                              f"not launch under the simulator (launched: {sorted(launched)}); "
                              f"correct phases() in tests/kernel_model.py")
        failed = [r for r in rows if "error" in r]
        if failed:
            raise RuntimeError(f"{case.key}: {name} did not compile: {failed[0]['error']}")
        figured = [dict(r, **kernel_figures(r)) for r in rows]
        return min(figured, key=lambda r: r["bandwidth"])  # the slowest variant

    counted, steps, serial = phases(case, real)
    detail_phases, time_700, time_800 = [], 0.0, 0.0
    for p in steps:
        if p.kernel:
            k = pick(p.kernel)
            bw, bw800 = k["bandwidth"], k["bandwidth_800ns"]
        else:
            bw = bw800 = LIBRARY_EFFICIENCY * COPY_BANDWIDTH
        t, t800 = p.bytes / bw, p.bytes / bw800
        time_700 += t
        time_800 += t800
        detail_phases.append({"name": p.name, "kernel": p.kernel, "bytes": int(p.bytes),
                              "bandwidth": bw, "seconds": t, "seconds_800ns": t800})
    main = pick(case.main)
    fraction = counted / time_700 / COPY_BANDWIDTH
    launches, syncs = host
    library = sum(1 for p in steps if not p.kernel)
    host_s = (launches + library) * HOST_PER_LAUNCH + syncs * HOST_PER_SYNC
    op_s = time_700 + host_s if syncs else max(time_700, host_s)
    row = {"op": case.op, "case": case.label, "registers": main["registers"],
           "blocks_per_sm": main["blocks_per_sm"],
           "bytes_in_flight_per_sm": main["bytes_in_flight_per_sm"],
           "modelled_fraction_of_copy": round(fraction, 3),
           "max_serial_items_per_warp": int(serial), "launches": int(launches),
           "host_syncs": int(syncs),
           "modelled_op_fraction_of_copy": round(counted / op_s / COPY_BANDWIDTH, 3)}
    modelled = {p.kernel for p in steps if p.kernel}
    kernels = [dict(r, **kernel_figures(r)) if "error" not in r else r
               for rows in launched.values() for r in rows]
    return {"key": case.key, "row": row, "counted_bytes": int(counted), "seconds": time_700,
            "host_seconds": host_s, "library_calls": library, "op_seconds": op_s,
            "seconds_800ns": time_800,
            "fraction_800ns": counted / time_800 / COPY_BANDWIDTH, "phases": detail_phases,
            "main": case.main, "kernels": kernels,
            "unmodelled_kernels": sorted(set(launched) - modelled)}


# ======================================================================================
# CSV, check, report
# ======================================================================================
def write_csv(details, path):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        out.writeheader()
        for d in details:
            if "error" in d:
                continue
            row = dict(d["row"])
            for column in ("modelled_fraction_of_copy", "modelled_op_fraction_of_copy"):
                row[column] = f"{row[column]:.3f}"
            out.writerow(row)


def read_csv(path):
    """``{"op,case": row}`` of a model CSV (numbers as floats)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: columns {reader.fieldnames}, expected {list(COLUMNS)}")
        return {f"{r['op']},{r['case']}": {k: (v if k in ("op", "case") else float(v))
                                            for k, v in r.items()} for r in reader}


def check(details, recorded, tolerance=TOLERANCE):
    """Problems of the computed ``details`` against ``recorded`` (:func:`read_csv`): a case
    missing from the CSV or no longer computed, a figure of :data:`HIGHER_IS_BETTER` lower
    or of :data:`LOWER_IS_BETTER` higher than recorded beyond ``tolerance`` (relative)."""
    problems = [f"{d['key']}: could not be computed: {d['error']}" for d in details if "error" in d]
    computed = {d["key"]: d["row"] for d in details if "error" not in d}
    for key in computed.keys() - recorded.keys():
        problems.append(f"{key}: not in the CSV (write it with --write)")
    failed = {d["key"] for d in details if "error" in d}
    for key in recorded.keys() - computed.keys() - failed:
        problems.append(f"{key}: in the CSV but no longer computed by the model")
    for key in sorted(computed.keys() & recorded.keys()):
        now, then = computed[key], recorded[key]
        for column in HIGHER_IS_BETTER:
            if now[column] < then[column] * (1 - tolerance):
                problems.append(f"{key}: {column} {now[column]} < recorded {then[column]:g}")
        for column in LOWER_IS_BETTER:
            if now[column] > then[column] * (1 + tolerance):
                problems.append(f"{key}: {column} {now[column]} > recorded {then[column]:g}")
    return problems


def _gb(x):
    return f"{x / 1e9:.3f}"


def markdown(model):
    """A Markdown report: the constants, a table of the cases, then each case's phases and
    kernels (hot loop, loads in flight)."""
    c = model["constants"]
    lines = [
        "# H100 kernel model (from ptxas and the SASS, no GPU)", "",
        f"Constants: {c['sms']} SMs, copy {c['copy_bandwidth'] / 1e12:.1f} TB/s (read + write), "
        f"DRAM latency {c['latency'] * 1e9:.0f} ns for the figures (range "
        f"{c['latency_range'][0] * 1e9:.0f}-{c['latency_range'][1] * 1e9:.0f} ns), library calls at "
        f"{c['library_efficiency']:.0%} of copy, radix sort {c['radix_bits']} bits per pass, "
        f"scattered accesses {c['sector']} B, L2 {c['l2_bytes'] >> 20} MiB. Real sizes: E={c['rows']}, "
        f"B={c['bags']}, Zipf({c['zipf']}) ids (seed {c['seed']}); distinct ids of the backward's "
        f"{c['bags'] * 32} ids K={model['real']['distinct_ids']}, of unique's {c['unique_ids']} ids "
        f"K={model['real']['unique_distinct_ids']}. Host (modelled): "
        f"{c['host_per_launch'] * 1e6:.0f} us per launch or library call, "
        f"{c['host_per_sync'] * 1e6:.0f} us per sync.", "",
        "| op | case | registers | blocks/SM | bytes in flight/SM | modelled fraction of copy "
        "(700 ns) | at 800 ns | modelled ms | max serial items/warp | launches + library calls "
        "| syncs | host ms | op's fraction of copy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in model["cases"]:
        if "error" in d:
            op, case = d["key"].split(",", 1)
            lines.append(f"| {op} | {case} | error: {d['error']} ||||||||||||")
            continue
        r = d["row"]
        lines.append(f"| {r['op']} | {r['case']} | {r['registers']} | {r['blocks_per_sm']} | "
                     f"{r['bytes_in_flight_per_sm']} | {r['modelled_fraction_of_copy']:.3f} | "
                     f"{d['fraction_800ns']:.3f} | {d['seconds'] * 1e3:.3f} | "
                     f"{r['max_serial_items_per_warp']} | {r['launches']} + {d['library_calls']} | "
                     f"{r['host_syncs']} | {d['host_seconds'] * 1e3:.3f} | "
                     f"{r['modelled_op_fraction_of_copy']:.3f} |")
    for d in (d for d in model["cases"] if "error" not in d):
        lines += ["", f"## {d['key']}", "",
                  f"Counted bytes {_gb(d['counted_bytes'])} GB; modelled time "
                  f"{d['seconds'] * 1e3:.3f} ms (800 ns: {d['seconds_800ns'] * 1e3:.3f} ms). "
                  f"Main kernel: {d['main']}.", "",
                  "| phase | kernel or library | GB | GB/s | ms |", "|---|---|---|---|---|"]
        for p in d["phases"]:
            lines.append(f"| {p['name']} | {p['kernel'] or 'library'} | {_gb(p['bytes'])} | "
                         f"{p['bandwidth'] / 1e9:.0f} | {p['seconds'] * 1e3:.4f} |")
        lines += ["", "| kernel | factory args | registers | threads | blocks/SM | loads in flight "
                  "per lane | bytes/lane | bytes in flight/SM | first use | innermost loops (head: "
                  "loads, bytes in flight per lane) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for k in d["kernels"]:
            if "error" in k:
                lines.append(f"| {k['kernel']} | {k['factory_args']} | error: {k['error']} |||||||")
                continue
            loop = k["loop"]
            loads = " ".join(op for _, op, _ in loop["loads"]) or "none"
            first_use = str(loop["first_use"]).replace("|", "\\|")  # a Markdown table cell
            loops = ", ".join(f"{head}: {n}, {b}" + (" (hot)" if loop["loop_head"] is not None
                                                      and int(head, 16) == loop["loop_head"] else "")
                              for head, n, b in loop["innermost"])
            lines.append(f"| {k['kernel']} | {k['factory_args']} | {k['registers']} | {k['threads']} | "
                         f"{k['blocks_per_sm']} | {loads} | {loop['bytes_per_lane']} | "
                         f"{k['bytes_in_flight_per_sm']} | `{first_use}` | {loops} |")
        if d["unmodelled_kernels"]:
            lines += ["", f"Launched but in no phase: {', '.join(d['unmodelled_kernels'])}."]
    return "\n".join(lines) + "\n"


def write_report(model, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(model, indent=1, default=str) + "\n")
    else:
        path.write_text(markdown(model))


def main(argv):
    if argv[:1] == ["record-launches"]:
        record_cases(argv[1])
        return 0
    if argv[:1] == ["compile-launches"]:
        compile_cases(*argv[1:])
        return 0
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="CSV", help="compute every case and write the CSV")
    mode.add_argument("--check", metavar="CSV", help="compute every case and compare with the CSV")
    parser.add_argument("--report", metavar="PATH", help="detail report (.json: JSON, else Markdown)")
    parser.add_argument("--sass", metavar="DIR", help="write each kernel's SASS listing to DIR")
    opts = parser.parse_args(argv)
    missing = missing_tools()
    if missing:
        print(f"kernel_model: missing {', '.join(missing)}: pip install -e '.[test]'", file=sys.stderr)
        return 2
    model = compute(sass_dir=opts.sass)
    if opts.report:
        write_report(model, opts.report)
    for d in model["cases"]:
        if "error" in d:
            print(f"{d['key']:<55} ERROR {d['error']}")
            continue
        r = d["row"]
        print(f"{d['key']:<55} {r['registers']:>4} regs {r['blocks_per_sm']:>2} blocks "
              f"{r['bytes_in_flight_per_sm']:>6} B in flight {r['modelled_fraction_of_copy']:.3f} of copy "
              f"serial {r['max_serial_items_per_warp']}")
    print(f"({model['seconds']} s: {model['step_seconds']})")
    errors = [d for d in model["cases"] if "error" in d]
    if opts.write:
        write_csv(model["cases"], opts.write)
        print(f"wrote {opts.write}" + (f", without the {len(errors)} cases in error" if errors else ""))
        return 1 if errors else 0
    problems = check(model["cases"], read_csv(opts.check))
    for p in problems:
        print(f"REGRESSION {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
