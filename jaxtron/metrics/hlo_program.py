"""A compiled program's optimized HLO text, indexed for pricing: its computations and how often each runs, every
instruction's type, the bytes a fusion reads and writes, and the GEMM a fusion calls."""

from __future__ import annotations

import itertools
import re

from jaxtron.metrics.hlo import GEMM_TARGETS, computations, definitions, runs_per_execution, type_bytes

LINE = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+) = (.*)$")
CALLS = re.compile(r"\bcalls=(%[\w.\-]+)")
_IN_PLACE = ("dynamic-update-slice", "scatter")  # fusion roots that update their first operand in place
TARGET = re.compile(r'custom_call_target="([^"]+)"')
TO_APPLY = re.compile(r"\bto_apply=(%[\w.\-]+)")
NESTED = re.compile(r"\b(?:body|condition|true_computation|false_computation)=(%[\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")


def split_instruction(rest: str) -> tuple[str, str, str]:
    """'TYPE opcode(operands), attributes' -> (TYPE, opcode, the text from the operands on)."""
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depths = itertools.accumulate((ch == "(") - (ch == ")") for ch in rest)
        end = next(i for i, depth in enumerate(depths) if depth == 0)
        type_text, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    opcode, _, tail = rest.partition("(")
    return type_text, opcode.strip(), tail


def tuple_parts(type_text: str) -> list[str]:
    """The top-level parts of a tuple type '(A, (B, C), D)'."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(type_text):
        depth += (ch in "({[") - (ch in ")}]")
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            parts.append(type_text[start:i].strip())
            start = i + 1
    return parts


def operand_names(tail: str) -> list[str]:
    """The operands of an instruction: the names inside its first parentheses."""
    depth, end = 1, len(tail)
    for i, ch in enumerate(tail):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%[\w.\-]+", tail[:end])


class Program:
    """The optimized HLO text, indexed: computations, their runs per execution, every instruction's type."""

    def __init__(self, hlo_text: str):
        self.comps, self.runs = runs_per_execution(hlo_text)
        _, self.entry = computations(hlo_text)
        self.shapes = definitions(hlo_text)
        self.types: dict[str, str] = {}  # instruction name -> its type text (tuples too)
        for lines in self.comps.values():
            for line in lines:
                m = LINE.match(line)
                if m:
                    self.types[m.group(1)] = split_instruction(m.group(2))[0]

    def kernel_level(self) -> list[str]:
        """The computations whose instructions are kernels: the entry, loop bodies and conditions, conditional
        branches, called and asynchronous computations (not fused computations, reducers or comparators)."""
        out, stack = [], [self.entry] if self.entry else []
        while stack:
            name = stack.pop()
            if name in out or name not in self.comps:
                continue
            out.append(name)
            for line in self.comps[name]:
                for one, several in NESTED.findall(line):
                    stack += [c.strip().lstrip("%") for c in (one or several).split(",")]
                m = LINE.match(line)
                opcode = split_instruction(m.group(2))[1] if m else ""
                if opcode == "call":
                    stack += [c.lstrip("%") for c in TO_APPLY.findall(line)]
                elif opcode == "async-start":
                    stack += [c.lstrip("%") for c in CALLS.findall(line)]
        return out

    def instructions(self):
        """(computation, its runs per execution, line, name, type text, opcode, the text from the operands on) of
        each instruction of the kernel-level computations that run, in each computation's (scheduled) order."""
        for comp in self.kernel_level():
            runs = self.runs.get(comp, 0)
            if not runs:
                continue
            for line in self.comps[comp]:
                m = LINE.match(line)
                if m:
                    yield (comp, runs, line, m.group(1), *split_instruction(m.group(2)))

    def operand_bytes(self, name: str) -> int:
        return type_bytes(self.types.get(name, ""))

    def fusion_bytes(self, fused: str, operands: list[str], result_type: str) -> float:
        """Bytes a fusion reads and writes: an operand that the fused computation only slices counts as its
        slices; a buffer updated in place (dynamic-update-slice or scatter at the root) as the update written,
        not read."""
        lines = self.comps.get(fused, [])
        params: dict[str, int] = {}  # fused parameter name -> operand index
        users: dict[str, list[tuple[str, str, list[str]]]] = {}  # name -> [(user, opcode, operands)]
        defs: dict[str, tuple[str, str, list[str]]] = {}
        root = None
        for line in lines:
            m = LINE.match(line)
            if not m:
                continue
            type_text, opcode, tail = split_instruction(m.group(2))
            ops = operand_names(tail)
            defs[m.group(1)] = (type_text, opcode, ops)
            if opcode == "parameter":
                params[m.group(1)] = int(re.match(r"\s*(\d+)", tail).group(1))
            for o in ops:
                users.setdefault(o, []).append((m.group(1), opcode, ops))
            if line.lstrip().startswith("ROOT"):
                root = m.group(1)
        outputs = [root] if root else []
        if root and defs[root][1] == "tuple":
            outputs = defs[root][2]
        in_place = {defs[o][2][0] for o in outputs if o in defs and defs[o][1] in _IN_PLACE}
        written = 0.0
        for o in outputs:
            if o not in defs:
                continue
            type_text, opcode, ops = defs[o]
            if opcode == "dynamic-update-slice":
                written += type_bytes(defs[ops[1]][0])
            elif opcode == "scatter":  # the rows it adds into, read and written (a combiner reads its target)
                written += 2 * type_bytes(defs[ops[2]][0]) if len(ops) > 2 and ops[2] in defs else 0
            else:
                written += type_bytes(type_text)
        if not outputs:
            written = type_bytes(result_type)
        read = 0.0
        for param, index in params.items():
            if index >= len(operands):
                continue
            whole = self.operand_bytes(operands[index])
            read += self._read(param, whole, users, defs, in_place)
        return read + written

    def _read(self, name: str, whole: int, users, defs, in_place: set[str]) -> float:
        """Bytes of value ``name`` (of ``whole`` bytes) that its users in a fused computation read."""
        if name in in_place:
            return 0.0
        total = 0.0
        for user, opcode, ops in users.get(name, []):
            if opcode == "bitcast":
                total += self._read(user, whole, users, defs, in_place)
            elif opcode in ("dynamic-slice", "slice", "gather") and ops and ops[0] == name:
                total += type_bytes(defs[user][0])
            elif opcode in _IN_PLACE and ops and ops[0] == name and user in in_place:
                continue
            else:
                return float(whole)
        return min(total, float(whole))

    def called_dot(self, fused: str) -> str | None:
        """The dot instruction inside a GEMM fusion (nested fusions searched too)."""
        return self._called(fused, lambda line: " dot(" in line)

    def called_library_gemm(self, fused: str) -> str | None:
        """The library GEMM call inside a fusion: XLA's dynamic-slice fusion wraps a cuBLAS call that reads a
        slice or writes into one in place."""
        return self._called(fused, lambda line: TARGET.search(line) is not None
                            and TARGET.search(line).group(1) in GEMM_TARGETS)

    def _called(self, fused: str, matches) -> str | None:
        stack, seen = [fused], set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            for line in self.comps.get(name, []):
                if matches(line):
                    return line
                stack += [c.lstrip("%") for c in CALLS.findall(line)]
        return None
