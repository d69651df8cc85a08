"""Reading the TPU compiler's optimized HLO text and its cost model, per chip.

`cost(lowered)` compiles a lowered program and returns its cost model's figures (`FIELDS`: flops, bytes accessed,
optimal seconds; the -1 s the model gives each ConcatBitcast in the entry and loop bodies added back as
`uncosted_ops`), the trip counts of its while loops and its compile time. `through_layers(lower, layers)` compiles
`lower(depth)` at `depths(layers)` (0, d and L layers) and resolves the layer scan, whose body the cost model counts
once, by the model cost(depth) = a + b·depth + c·[depth > 0]: the figure at `layers` is a + b·layers + c·layers, the
components kept as `*_once`, `*_per_layer_outside_loop` and `*_layer_body`. `once(lowered)` is a program without
loops. `valid` marks figures whose programs kept no loop but a layer scan of one layer per iteration and no negative
time.

`fitting(name, lower, layers, rows, step, log)` is `through_layers` at a row count, or where the chip cannot hold
that program, at fewer rows and extrapolated; `custom_calls(hlo)` counts the Mosaic kernels by hand, which `cost` adds.

`breakdown(hlo)` lists the instructions of every while loop's body with the bytes each reads and writes by the
convention of XLA's HloCostAnalysis (`breakdown_table` prints them); `SHAPE` matches an array shape in HLO text and
`shapes_bytes` sums the bytes of the shapes written in a text.
"""

from __future__ import annotations

import functools
import math
import re
import time

FIELDS = ("flops", "bytes_accessed", "optimal_seconds", "optimal_seconds_declared", "optimal_seconds_square")
HBM_BYTES_PER_S = 819e9  # TPU v5e


def _computations(hlo: str) -> dict[str, list[str]]:
    """An optimized HLO module's computations by name, each its instruction lines (an instruction's attributes may
    run on over further lines, as a Mosaic kernel's do: those are left out)."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$", line)
        if head:
            name = head.group(1)
            out[name] = []
        elif line.rstrip() == "}":
            name = None
        elif name and line.startswith("  ") and " = " in line:
            out[name].append(line.strip())
    return out


def _loops(hlo: str) -> list[tuple[str, int]]:
    """(body computation, trip count) of every while loop of an optimized HLO module (trip count -1 where its
    condition is not `i < constant`)."""
    computations = _computations(hlo)
    loops = []
    for condition, body in re.findall(r"\bwhile\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)", hlo):
        text = "\n".join(computations.get(condition, []))
        found = re.search(r"constant\((\d+)\)", text)
        loops.append((body, int(found.group(1)) if found and "direction=LT" in text else -1))
    return loops


def _trip_counts(hlo: str) -> list[int]:
    """The trip count of every while loop of an optimized HLO module (-1 where its condition is not `i < constant`)."""
    return [trip for _, trip in _loops(hlo)]


def _uncosted(hlo: str) -> int:
    """ConcatBitcast custom calls (buffers joined in place, no data moved) in the computations whose cost the model
    sums, the entry and the while bodies: it gives each -1 s (conditional branches' are not summed)."""
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo))
    count, current = 0, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) \(", line)
        if head:
            current = "ENTRY" if head.group(1) else head.group(2)
        elif 'custom_call_target="ConcatBitcast"' in line and (current == "ENTRY" or current in bodies):
            count += 1
    return count


def _cost_analysis(compiled) -> dict:
    ca = compiled.cost_analysis()
    return (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else (ca or {})


_MATMUL_RATES: dict[tuple, float] = {}


def matmul_rate(device, block: int, width: int) -> float:
    """FLOP/s the cost model gives XLA's batched bfloat16 product of an attention kernel's blocks (512 products of
    [block, width] by [width, block], float32 out) on `device`'s kind of chip; with `block` 0, a square 8192 x 8192
    product's (the chip's peak, on a v5e). The first prices a kernel's hand-counted FLOPs as the cost model prices
    the same products in XLA's attention and in the calibration programs; the second, as a large product."""
    key = (device.device_kind, block, width)
    if key not in _MATMUL_RATES:
        import jax
        import jax.numpy as jnp

        one = jax.sharding.SingleDeviceSharding(device)
        if block:
            x = y = jax.ShapeDtypeStruct((512, block, width), jnp.bfloat16, sharding=one)
            product = functools.partial(jnp.einsum, "nqh,nkh->nqk", preferred_element_type=jnp.float32)
        else:
            x = y = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16, sharding=one)
            product = jnp.dot
        ca = _cost_analysis(jax.jit(product).lower(x, y).compile())
        _MATMUL_RATES[key] = float(ca["flops"]) / float(ca["optimal_seconds"])
    return _MATMUL_RATES[key]


def custom_calls(hlo: str) -> list[dict]:
    """The hand count of every Mosaic kernel (tpu_custom_call) in the computations the cost model sums (the entry and
    the while bodies), whose own cost is what the kernel declares (splash attention: nothing). Each is the splash
    kernel by its name (`splash_mha_fwd…`, `…_dq…`, `…_dkv…`), its operands q [b, Q, P, H], k and v [b, K, P, H]
    (or without b: one row):

        FLOPs   the causal blocks' pairs (n(n+1)/2 blocks of block² pairs, n = P / block, per row and query head)
                times 4H (forward: q·kᵀ and p·v), 6H (dq: the scores again, dO·vᵀ and ds·k), 8H (dkv: the scores
                again, pᵀ·dO, dO·vᵀ and dsᵀ·q) or 10H (the fused backward: dkv's and ds·k);
        bytes   what it must move: forward q, k, v in and o out (and, saving residuals, the log-sum-exp, float32 per
                query); dq and dkv q, k, v, dO, the log-sum-exp and dO·o's row sums in, dq (or dk and dv) out; the
                fused backward dkv's and its dq partial sums (one per key block) out.

    A kernel not of that form raises: its cost would otherwise be whatever it declares."""
    from esroll.models.attention import splash_block

    summed = {body for body, _ in _loops(hlo)} | {_entry_name(hlo)}
    found = []
    for name, lines in _computations(hlo).items():
        for line in lines:
            if 'custom_call_target="tpu_custom_call"' not in line:
                continue
            kernel = _split_instruction(line)[0]
            if name not in summed:
                raise ValueError(f"{kernel}: a Mosaic kernel in {name}, outside the entry and the loop bodies")
            operands = re.search(r"operand_layout_constraints=\{(.*?)\}(?:, [\w.]+=|$)", line)
            # [b, heads, P, H], or [heads, P, H] for a call on one row
            floats = [(t, (1,) * (len(s) == 3) + s) for t, s in _floats(operands.group(1) if operands else "")]
            kind = next((k for k in ("fwd", "dkv", "dq") if f"_{k}" in kernel), None)
            if not kernel.startswith("splash_") or kind is None or len(floats) < 3:
                raise ValueError(
                    f"{kernel}: a Mosaic kernel this cost count does not know; its cost is what it declares"
                )
            (t, (b, q_heads, P, H)), (_, (_, kv_heads, _, _)) = floats[0], floats[1]
            item = _ITEMSIZE[t]
            block = splash_block(P)
            n = P // block
            pairs = b * q_heads * block * block * n * (n + 1) // 2
            q_bytes, kv_bytes, row_bytes = b * q_heads * P * H * item, b * kv_heads * P * H * item, b * q_heads * P * 4
            if kind == "fwd":
                flops, moved = 4 * H * pairs, 2 * q_bytes + 2 * kv_bytes + row_bytes * ("_no_residuals" not in kernel)
            elif kind == "dq":
                flops, moved = 6 * H * pairs, 3 * q_bytes + 2 * kv_bytes + 2 * row_bytes
            else:
                flops, moved = 8 * H * pairs, 2 * q_bytes + 4 * kv_bytes + 2 * row_bytes
                # The fused backward (one kernel for dq, dk and dv): dq's partial sums over the key blocks written
                # out too (an output ending in q's [Q, P, H]), and the products of dq (2H more per pair).
                partials = [(u, s) for u, s in _floats(_split_instruction(line)[1]) if s[-3:] == (q_heads, P, H)]
                if partials:
                    flops += 2 * H * pairs
                    moved += sum(math.prod(s) * _ITEMSIZE[u] for u, s in partials)
            found.append(
                {"kernel": kernel, "computation": name, "flops": flops, "bytes": moved, "block": block, "width": H}
            )
    return found


def _floats(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of each floating-point array of rank 3 or more written in `text`."""
    arrays = [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims, _ in SHAPE.findall(text)]
    return [(t, s) for t, s in arrays if t in ("bf16", "f16", "f32") and len(s) >= 3]


def _device(lowered):
    """A device the lowered program runs on (its arguments' shardings'; `Compiled.input_shardings` cannot rebuild
    every program's argument tree)."""
    for s in lowered._lowering.compile_args["in_shardings"]:
        if hasattr(s, "device_set"):
            return next(iter(s.device_set))
    raise ValueError("a program with no sharded argument: no device to price its kernels on")


def _entry_name(hlo: str) -> str:
    found = re.search(r"^ENTRY %?([\w.\-]+) \(", hlo, re.M)
    return found.group(1) if found else ""


def cost(lowered) -> dict:
    """The cost model's figures of the compiled program (absent keys: 0), the trip counts of its while loops and its
    compile time. Its Mosaic kernels (`custom_calls`) are counted by hand and added: their FLOPs and bytes, and
    max(bytes / HBM bandwidth, FLOPs / `matmul_rate` of their blocks) seconds each; `optimal_seconds_square` prices
    their FLOPs at a large square product's rate instead (the two bound what the cost model would give a kernel it
    could see into); `optimal_seconds_declared` is the figure without them (what the kernels declare: nothing for
    splash attention, a thousandth of a millisecond)."""
    t0 = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    ca = _cost_analysis(compiled)
    hlo = compiled.as_text()
    raw, uncosted = float(ca.get("optimal_seconds", 0.0)), _uncosted(hlo)
    kernels = custom_calls(hlo)
    kernel_seconds = kernel_seconds_square = 0.0
    if kernels:
        device = _device(lowered)
        kernel_seconds = sum(
            max(k["bytes"] / HBM_BYTES_PER_S, k["flops"] / matmul_rate(device, k["block"], k["width"])) for k in kernels
        )
        square = matmul_rate(device, 0, 0)
        kernel_seconds_square = sum(max(k["bytes"] / HBM_BYTES_PER_S, k["flops"] / square) for k in kernels)
    return {
        "flops": float(ca.get("flops", 0.0)) + sum(k["flops"] for k in kernels),
        "bytes_accessed": float(ca.get("bytes accessed", 0.0)) + sum(k["bytes"] for k in kernels),
        "optimal_seconds": raw + uncosted + kernel_seconds,
        "optimal_seconds_declared": raw + uncosted,
        "optimal_seconds_square": raw + uncosted + kernel_seconds_square,
        "optimal_seconds_raw": raw,
        "uncosted_ops": uncosted,
        "kernels": len(kernels),
        "kernel_seconds": kernel_seconds,
        "kernel_seconds_square": kernel_seconds_square,
        "trip_counts": _trip_counts(hlo),
        "compile_s": round(seconds, 1),
    }


def depths(layers: int) -> tuple[int, int, int]:
    return (0, 3, 4) if layers <= 4 else (0, 4, layers)


def through_layers(lower, layers: int, known: dict | None = None) -> dict:
    """`lower(depth)` compiled at `depths(layers)` (but for the depths `known` already holds the cost of) and
    resolved to `layers` layers (the module docstring); `counted` keeps each depth's own figures. `valid`: every loop
    left is a layer scan of one layer per iteration (trip count = depth, none at depth 0) and every optimal_seconds
    is non-negative (the cost model gives -1 s for an op it cannot cost)."""
    compiled = depths(layers)
    costs = {d: (known or {}).get(d) or cost(lower(d)) for d in compiled}
    d0, d1, d2 = compiled
    out = {}
    for f in FIELDS:
        a = costs[d0][f]
        b = (costs[d2][f] - costs[d1][f]) / (d2 - d1)
        c = costs[d1][f] - a - b * d1
        out[f] = a + b * layers + c * layers
        out[f"{f}_once"], out[f"{f}_per_layer_outside_loop"], out[f"{f}_layer_body"] = a, b, c
    out["counted"] = costs
    out["trip_counts"] = {d: costs[d]["trip_counts"] for d in compiled}
    out["valid"] = all(
        all(n == d for n in costs[d]["trip_counts"]) and (d == 0) == (not costs[d]["trip_counts"]) for d in compiled
    ) and all(costs[d]["optimal_seconds"] >= 0 for d in compiled)
    out["compile_s"] = sum(costs[d]["compile_s"] for d in compiled)
    return out


def fitting(name: str, lower, layers: int, rows: int, step: int, log) -> dict:
    """`lower(depth, r)`'s figures through the layers at r = `rows`. Where the chip cannot hold that program (the TPU
    compiler refuses it: RESOURCE_EXHAUSTED), the rows are halved (while a multiple of `step`) until it compiles, r,
    and the figures are extrapolated linearly in the rows from r and r/2 to `rows` (a program's work is linear in its
    rows, plus what runs once: the weights read, the optimizer step). The depth components (`*_once`,
    `*_layer_body`, ...) and `counted` are then those of r rows, `counted_half_rows` those of r/2; `rows_compiled`
    says which were compiled."""
    import jax

    r = rows
    while True:
        try:
            full = cost(lower(layers, r))
            break
        except jax.errors.JaxRuntimeError as e:
            # r/2 must leave a half, r/4, of whole steps to extrapolate from
            if "RESOURCE_EXHAUSTED" not in str(e) or r % (4 * step):
                raise
            log(f"  {name}: {r} rows do not fit ({str(e).splitlines()[0][:120]}); halving", flush=True)
            r //= 2
    program = through_layers(lambda d: lower(d, r), layers, known={layers: full})
    program["rows_compiled"] = [r]
    if r == rows:
        return program
    half = through_layers(lambda d: lower(d, r // 2), layers)
    for f in FIELDS:
        program[f] = program[f] + (rows - r) * (program[f] - half[f]) / (r - r // 2)
    program["rows_compiled"] = [r, r // 2]
    program["counted_half_rows"] = half["counted"]
    program["valid"] = program["valid"] and half["valid"]
    program["compile_s"] += half["compile_s"]
    return program


def once(lowered) -> dict:
    """A program without loops, compiled once; `valid` as in `through_layers`."""
    out = cost(lowered)
    out["valid"] = not out["trip_counts"] and out["optimal_seconds"] >= 0
    return out


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_ITEMSIZE.update({"s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16})
SHAPE = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\](\{[^}]*\})?")
_SKIP = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id", "replica-id"}


def shapes_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (unpadded: dims × itemsize)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[t] for t, dims, _ in SHAPE.findall(text))


def _split_instruction(line: str):
    """(name, output shape text, opcode, operand text, attributes) of one HLO instruction line."""
    line = line.removeprefix("ROOT ")
    name, rest = line.split(" = ", 1)
    if rest.startswith("("):  # a tuple shape: up to its matching parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        shape, rest = rest[: i + 1], rest[i + 2 :]
    else:
        shape, rest = rest.split(" ", 1)
    opcode, rest = rest.split("(", 1)
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    return name.lstrip("%"), shape, opcode, rest[:i], rest[i + 1 :]


def _operands(text: str) -> list[str]:
    """The operand texts of an instruction (split at top-level commas)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def _fusion_bytes(lines: list[str], layers: int) -> tuple[int, list[str]]:
    """Bytes a fusion moves, by the convention of XLA's HloCostAnalysis: each operand read once, except one used
    only by dynamic-slices inside (the slices' bytes), a layer-stacked one (leading axis `layers`, read through a
    window of a matrix product: one layer's bytes) or the buffer of an in-place dynamic-update-slice (nothing); the
    output written, except an in-place dynamic-update-slice's (its update's bytes). Also the notable ops inside
    (dynamic-slice, dynamic-update-slice, transpose, copy, dot, convolution, gather, reduce)."""
    parsed = [_split_instruction(line) for line in lines]
    by_name = {p[0]: p for p in parsed}
    params = [name for name, _, opcode, _, _ in parsed if opcode == "parameter"]
    users = {name: [] for name in by_name}
    for name, _, opcode, args, _ in parsed:
        for j, operand in enumerate(_operands(args)):
            ref = operand.split()[-1].lstrip("%") if operand else ""
            if ref in users:
                users[ref].append((name, opcode, j))
    root = _split_instruction(next(line for line in lines if line.startswith("ROOT ")))
    roots = [root]
    if root[2] == "tuple":
        roots = [by_name[o.split()[-1].lstrip("%")] for o in _operands(root[3])]
    in_place = set()
    written = 0
    for r in roots:
        if r[2] == "dynamic-update-slice":
            ops = _operands(r[3])
            in_place.add(ops[0].split()[-1].lstrip("%"))
            written += shapes_bytes(ops[1])
        else:
            written += shapes_bytes(r[1])
    read = 0
    for name in params:
        uses = users[name]
        if name in in_place:
            continue
        if uses and all(op == "dynamic-slice" and j == 0 for _, op, j in uses):
            read += sum(shapes_bytes(by_name[u][1]) for u, _, _ in uses)
        else:
            shape = SHAPE.search(by_name[name][1])
            stacked = shape and layers > 1 and shape.group(2).split(",")[0] == str(layers)
            read += shapes_bytes(by_name[name][1]) // (layers if stacked else 1)
    notable = sorted(
        {
            p[2]
            for p in parsed
            if p[2] in ("dynamic-slice", "dynamic-update-slice", "transpose", "copy", "dot", "convolution", "gather")
            or p[2].startswith("reduce")
        }
    )
    return read + written, notable


def breakdown(hlo: str) -> list[dict]:
    """The instructions of every while loop's body of an optimized HLO module, each with the bytes it moves (XLA's
    HloCostAnalysis convention: operands read and output written; see `_fusion_bytes`), largest first. What the
    layer body of a decode step spends its bytes on, instruction by instruction."""
    comps = _computations(hlo)
    rows = []
    for body, trip in _loops(hlo):
        parsed = [_split_instruction(line) for line in comps.get(body, [])]
        shapes = {p[0]: p[1] for p in parsed}  # operands are named, their shapes are their definitions'
        for name, shape, opcode, args, attrs in parsed:
            if opcode in _SKIP or opcode == "while":
                continue
            operands = [shapes.get(o.split()[-1].lstrip("%"), o) for o in _operands(args) if o]
            inside = []
            called = re.search(r"calls=%?([\w.\-]+)", attrs)
            if opcode == "fusion" and called and called.group(1) in comps:
                moved, inside = _fusion_bytes(comps[called.group(1)], trip)
                kind = re.search(r"kind=(\w+)", attrs)
                opcode = f"fusion:{kind.group(1) if kind else ''}"
            elif opcode == "dynamic-update-slice":
                moved = 2 * shapes_bytes(operands[1])
            elif opcode == "dynamic-slice":
                moved = 2 * shapes_bytes(shape)
            else:
                moved = sum(shapes_bytes(o) for o in operands) + shapes_bytes(shape)
            rows.append({"body": body, "name": name, "opcode": opcode, "bytes": moved, "shape": shape, "ops": inside})
    return sorted(rows, key=lambda r: -r["bytes"])


def breakdown_table(rows: list[dict], limit: int = 40) -> str:
    lines = [f"{'MB':>10}  {'opcode':<24}{'name':<36}output shape; ops inside"]
    for r in rows[:limit]:
        inside = f"; {','.join(r['ops'])}" if r["ops"] else ""
        lines.append(f"{r['bytes'] / 1e6:>10.2f}  {r['opcode']:<24}{r['name'][:35]:<36}{r['shape'][:90]}{inside}")
    lines.append(f"{sum(r['bytes'] for r in rows) / 1e6:>10.2f}  in all ({len(rows)} instructions)")
    return "\n".join(lines)
