"""Human-readable views of a plan: a table of its steps, Graphviz, and why keys differ."""

from __future__ import annotations

import struct

from . import _core

_GRAPH_BREAKS = ("opaque", "eager_accumulate")


def table(plan: _core.Plan, themselves: frozenset[int] = frozenset()) -> str:
    """One row per engine step: node, sequence_nr, inputs, saved values, mode, hooks; the
    traced steps in ``themselves`` (those a compiled replay runs as themselves) as
    opaque."""
    rows = [("step", "node", "sequence_nr", "inputs", "saved", "mode", "hooks")]
    # Steps whose last saved values come from checkpointing's unpack hook, by block.
    hooked = {s: (count, group) for s, count, group in plan.hooked_steps()}
    for s, step in enumerate(plan.steps()):
        name, _kind, mode, seq, num_inputs, _n_out, a, b, slots, _targets, hooks, captures = step
        mode = "opaque" if s in themselves else mode
        arrivals = sum(len(srcs) for srcs in slots)
        inputs = f"{num_inputs}" + (f" ({arrivals} grads)" if arrivals != num_inputs else "")
        hook_text = ",".join(f"{k}{'' if py else '[c++]'}" for k, _i, py, _v in hooks) or "-"
        if captures:
            hook_text += f" capture{[k for _j, k in captures]}"
        seq_text = "max" if seq == 2**64 - 1 else str(seq)
        saved = str(b - a)
        if s in hooked:
            saved += f" ({hooked[s][0]} unpacked, block {hooked[s][1]})"
        rows.append((str(s), name, seq_text, inputs, saved, mode, hook_text))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    breaks = sum(
        1 for s, step in enumerate(plan.steps()) if step[2] in _GRAPH_BREAKS or s in themselves
    )
    blocks = len({group for _count, group in hooked.values()})
    lines.append(
        f"{plan.num_steps} steps, {plan.num_saved} saved values, {breaks} graph breaks"
        + (f" and {blocks} checkpointed blocks (unpacked at their first step)" if blocks else "")
        + f", key {plan.key}"
    )
    return "\n".join(lines)


def _quote(text: str) -> str:
    """A Graphviz string literal (newlines become line breaks)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def to_dot(plan: _core.Plan, themselves: frozenset[int] = frozenset()) -> str:
    """Graphviz source: one node per step (graph breaks in red), edges labelled with the
    input they feed; ``themselves``: see :func:`table`."""
    out = ["digraph replaygrad {", "  rankdir=TB;", "  node [shape=box, fontname=monospace];"]
    out.append('  root [label="root gradients", shape=ellipse];')
    for s, step in enumerate(plan.steps()):
        name, _kind, mode, _seq, _ni, _no, a, b, slots, _targets, hooks, _caps = step
        mode = "opaque" if s in themselves else mode
        label = f"{s}: {name}\n{mode}"
        if b > a:
            label += f", {b - a} saved"
        if hooks:
            label += f", {len(hooks)} hooks"
        attrs = [f"label={_quote(label)}"]
        if mode in _GRAPH_BREAKS:
            attrs += ["color=red", "style=dashed", 'tooltip="graph break"']
        elif mode == "skipped":
            attrs += ["color=gray"]
        out.append(f"  s{s} [{', '.join(attrs)}];")
        for input_nr, sources in enumerate(slots):
            for src, index in sources:
                origin = "root" if src < 0 else f"s{src}"
                out.append(f'  {origin} -> s{s} [label="{index}->{input_nr}"];')
    out.append("}")
    return "\n".join(out) + "\n"


_PARTS = ("structure", "input metadata", "specialization (non-tensor state, sizes)")


def key_difference(plan: _core.Plan, digests: bytes, names: list[str]) -> str:
    """Why ``plan``'s key differs from the plan whose step digests and node names are
    given: the first step and part of the key that differ."""
    new = plan.step_digests()
    new_names = plan.order()
    if len(new) != len(digests):
        return f"the graph has {len(new) // 24} steps, the cached replay {len(digests) // 24}"
    for s in range(len(new) // 24):
        a = struct.unpack_from("<3Q", new, 24 * s)
        b = struct.unpack_from("<3Q", digests, 24 * s)
        if a != b:
            part = next(_PARTS[i] for i in range(3) if a[i] != b[i])
            node = new_names[s] if new_names[s] == names[s] else f"{names[s]} -> {new_names[s]}"
            return f"step {s} ({node}): {part} changed"
    return "the roots or inputs changed"
