"""A small two-pass assembler for the Game Boy CPU (SM83).

It knows the whole SM83 instruction set and just enough directives to build one
32 KiB cartridge with no bank switching:

* ``SECTION "name", ROM0[$0150]``: start a section at an address. The types are
  ``ROM0`` ($0000-$7FFF, holds code and data), ``WRAM0`` ($C000-$DFFF) and ``HRAM``
  ($FF80-$FFFE); the last two only reserve space with ``ds``. Without ``[addr]`` a
  section starts where the previous section of the same type ended.
* ``db``, ``dw``, ``ds count[, fill]``; ``db`` also takes "strings".
* ``NAME EQU expr`` and ``DEF NAME EQU expr`` for constants (defined before use).
* Labels: ``Name:`` (global) and ``.name:`` (local, scoped to the last global label;
  reachable from elsewhere as ``Name.name``).
* Numbers: ``$ff``, ``0xff``, ``%1010``, ``0b1010``, ``123``, ``'A'``; ``@`` is the
  address of the current line. Operators, loosest first: ``|``, ``^``, ``&``,
  ``<< >>``, ``+ -``, ``* / %``, then unary ``- + ~``; ``HIGH(x)`` and ``LOW(x)``.
* Memory operands use square brackets: ``ld a, [hl+]``, ``ld [wScore], a``,
  ``ldh a, [$44]`` (``ldh`` also takes a full ``$FFxx`` address).

Pass one lays out every section and gives every label its address (an instruction's
length never depends on an operand's value); pass two evaluates the operands and emits
the bytes. Every error is an `AsmError` naming the file and line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["AsmError", "Assembly", "assemble"]


class AsmError(Exception):
    """A source error; the message starts with ``file:line:``."""

    def __init__(self, message: str, filename: str = "<asm>", line: int = 0) -> None:
        self.filename = filename
        self.line = line
        self.reason = message
        super().__init__(f"{filename}:{line}: {message}" if line else f"{filename}: {message}")


class _UnknownMnemonic(Exception):
    """A line starts with a word that is neither an instruction nor a directive."""


class _Undefined(Exception):
    """An expression names a symbol that has no value (yet)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


# ---------------------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<num>\$[0-9a-fA-F]+|0[xX][0-9a-fA-F]+|%[01]+|0[bB][01]+|[0-9]+)
      | (?P<char>'(?:[^'\\]|\\.)')
      | (?P<name>\.?[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)
      | (?P<op><<|>>|[-+*/%&|^~()@])
    )""",
    re.VERBOSE,
)

_BINARY_LEVELS: list[dict[str, Callable[[int, int], int]]] = [
    {"|": lambda a, b: a | b},
    {"^": lambda a, b: a ^ b},
    {"&": lambda a, b: a & b},
    {"<<": lambda a, b: a << b, ">>": lambda a, b: a >> b},
    {"+": lambda a, b: a + b, "-": lambda a, b: a - b},
    {"*": lambda a, b: a * b, "/": lambda a, b: _divide(a, b), "%": lambda a, b: _modulo(a, b)},
]


def _divide(a: int, b: int) -> int:
    if b == 0:
        raise ValueError("division by zero")
    return int(a / b)


def _modulo(a: int, b: int) -> int:
    if b == 0:
        raise ValueError("division by zero")
    return a - b * int(a / b)


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise ValueError(f"cannot read expression {text!r} at {text[pos:].strip()!r}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


def _number(text: str) -> int:
    if text.startswith("$"):
        return int(text[1:], 16)
    if text.startswith("%"):
        return int(text[1:], 2)
    return int(text, 0) if text[:2].lower() in ("0x", "0b") else int(text, 10)


class _Expr:
    """A parsed expression: evaluated later against a symbol lookup."""

    def __init__(self, text: str) -> None:
        self.text = text.strip()
        if not self.text:
            raise ValueError("missing expression")
        self.tokens = _tokenize(self.text)
        self._pos = 0
        self._check_syntax()

    def _check_syntax(self) -> None:
        # A dry run with every name worth 1 catches syntax errors at parse time.
        self.evaluate(lambda _name: 1, 0)

    def evaluate(self, lookup: Callable[[str], int], here: int) -> int:
        self._pos = 0
        self._lookup = lookup
        self._here = here
        value = self._binary(0)
        if self._pos != len(self.tokens):
            raise ValueError(f"unexpected {self.tokens[self._pos][1]!r} in {self.text!r}")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self._pos][1] if self._pos < len(self.tokens) else None

    def _take(self) -> tuple[str, str]:
        if self._pos >= len(self.tokens):
            raise ValueError(f"expression {self.text!r} ends too early")
        token = self.tokens[self._pos]
        self._pos += 1
        return token

    def _binary(self, level: int) -> int:
        if level == len(_BINARY_LEVELS):
            return self._unary()
        ops = _BINARY_LEVELS[level]
        value = self._binary(level + 1)
        while self._peek() in ops and self.tokens[self._pos][0] == "op":
            op = self._take()[1]
            value = ops[op](value, self._binary(level + 1))
        return value

    def _unary(self) -> int:
        token = self._peek()
        if token in ("-", "+", "~") and self.tokens[self._pos][0] == "op":
            self._take()
            value = self._unary()
            return -value if token == "-" else ~value if token == "~" else value
        return self._primary()

    def _primary(self) -> int:
        kind, text = self._take()
        if kind == "num":
            return _number(text)
        if kind == "char":
            body = text[1:-1]
            return ord(body[-1]) if body.startswith("\\") else ord(body)
        if text == "(":
            value = self._binary(0)
            if self._take()[1] != ")":
                raise ValueError(f"missing ')' in {self.text!r}")
            return value
        if text == "@":
            return self._here
        if kind == "name":
            if text.upper() in ("HIGH", "LOW") and self._peek() == "(":
                self._take()
                value = self._binary(0)
                if self._take()[1] != ")":
                    raise ValueError(f"missing ')' in {self.text!r}")
                return (value >> 8) & 0xFF if text.upper() == "HIGH" else value & 0xFF
            return self._lookup(text)
        raise ValueError(f"unexpected {text!r} in {self.text!r}")


# ---------------------------------------------------------------------------------------
# Operands
# ---------------------------------------------------------------------------------------

R8 = {"b": 0, "c": 1, "d": 2, "e": 3, "h": 4, "l": 5, "[hl]": 6, "a": 7}
R16 = {"bc": 0, "de": 1, "hl": 2, "sp": 3}  # ld rr,n16 / inc / dec / add hl
R16_STACK = {"bc": 0, "de": 1, "hl": 2, "af": 3}  # push / pop
CONDITIONS = {"nz": 0, "z": 1, "nc": 2, "c": 3}
ALU = {"add": 0, "adc": 1, "sub": 2, "sbc": 3, "and": 4, "xor": 5, "or": 6, "cp": 7}
CB_SHIFTS = {"rlc": 0, "rrc": 1, "rl": 2, "rr": 3, "sla": 4, "sra": 5, "swap": 6, "srl": 7}
CB_BITS = {"bit": 1, "res": 2, "set": 3}
SIMPLE = {
    "nop": 0x00, "rlca": 0x07, "rrca": 0x0F, "rla": 0x17, "rra": 0x1F, "daa": 0x27,
    "cpl": 0x2F, "scf": 0x37, "ccf": 0x3F, "halt": 0x76, "reti": 0xD9, "di": 0xF3,
    "ei": 0xFB,
}  # fmt: skip
_INDIRECT = {  # register-indirect forms other than [hl]
    "[bc]": "bc", "[de]": "de", "[hl+]": "hl+", "[hli]": "hl+", "[hl-]": "hl-",
    "[hld]": "hl-", "[c]": "c", "[$ff00+c]": "c", "[0xff00+c]": "c",
}  # fmt: skip


@dataclass
class _Operand:
    kind: str  # r8, r16, af, ind, mem, spoff, imm
    text: str
    reg: str = ""
    expr: _Expr | None = None


def _parse_operand(text: str) -> _Operand:
    raw = text.strip()
    squashed = re.sub(r"\s+", "", raw).lower()
    if squashed in R8:
        return _Operand("r8", raw, reg=squashed)
    if squashed in R16:
        return _Operand("r16", raw, reg=squashed)
    if squashed == "af":
        return _Operand("af", raw, reg="af")
    if squashed in _INDIRECT:
        return _Operand("ind", raw, reg=_INDIRECT[squashed])
    if raw.startswith("[") and raw.endswith("]"):
        return _Operand("mem", raw, expr=_Expr(raw[1:-1]))
    if re.match(r"sp\s*[-+]", raw, re.IGNORECASE):
        rest = raw.strip()[2:].strip()
        return _Operand("spoff", raw, expr=_Expr(rest))
    return _Operand("imm", raw, expr=_Expr(raw))


def _split_commas(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    quote = ""
    current = ""
    for char in text:
        if quote:
            current += char
            if char == quote:
                quote = ""
            continue
        if char in "\"'":
            quote = char
        elif char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += char
    if quote:
        raise ValueError("unterminated string")
    if current.strip() or parts:
        parts.append(current.strip())
    return parts


def _strip_comment(line: str) -> str:
    quote = ""
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "\"'":
            # a quote inside a char literal like ';' still pairs up correctly
            quote = char
        elif char == ";":
            return line[:i]
    return line


# ---------------------------------------------------------------------------------------
# Instruction encoding
# ---------------------------------------------------------------------------------------


class _Encoder:
    """Turns one instruction into bytes. `value()` gives an operand's value; in pass one
    it answers 0 for names not yet known and range checks are skipped."""

    def __init__(self, value: Callable[[_Expr], int], final: bool, pc: int) -> None:
        self.value = value
        self.final = final
        self.pc = pc

    def _fits(self, number: int, low: int, high: int, what: str) -> int:
        if self.final and not low <= number <= high:
            raise ValueError(f"{what} {number} out of range ({low}..{high})")
        return number

    def n8(self, op: _Operand) -> int:
        assert op.expr is not None
        return self._fits(self.value(op.expr), -128, 255, "8-bit value") & 0xFF

    def n16(self, op: _Operand) -> list[int]:
        assert op.expr is not None
        number = self._fits(self.value(op.expr), -32768, 65535, "16-bit value") & 0xFFFF
        return [number & 0xFF, number >> 8]

    def e8(self, op: _Operand) -> int:
        assert op.expr is not None
        return self._fits(self.value(op.expr), -128, 127, "signed offset") & 0xFF

    def relative(self, op: _Operand) -> int:
        assert op.expr is not None
        target = self.value(op.expr)
        offset = target - (self.pc + 2)
        if self.final and not -128 <= offset <= 127:
            raise ValueError(f"relative jump to ${target:04X} is {offset} bytes away (-128..127)")
        return offset & 0xFF

    def high_page(self, op: _Operand) -> int:
        assert op.expr is not None
        address = self.value(op.expr)
        if 0xFF00 <= address <= 0xFFFF:
            return address - 0xFF00
        return self._fits(address, 0, 0xFF, "ldh address") & 0xFF

    def encode(self, mnemonic: str, ops: list[_Operand]) -> list[int]:
        kinds = tuple(op.kind for op in ops)
        m = mnemonic
        if m in SIMPLE and not ops:
            return [SIMPLE[m]]
        if m == "stop" and not ops:
            return [0x10, 0x00]
        if m == "ld":
            return self._ld(ops, kinds)
        if m == "ldh":
            return self._ldh(ops, kinds)
        if m in ("ldi", "ldd") and len(ops) == 2:
            hl = "[hl+]" if m == "ldi" else "[hl-]"
            if kinds == ("r8", "r8") and ops[0].reg == "[hl]" and ops[1].reg == "a":
                return self._ld([_parse_operand(hl), ops[1]], ("ind", "r8"))
            if kinds == ("r8", "r8") and ops[0].reg == "a" and ops[1].reg == "[hl]":
                return self._ld([ops[0], _parse_operand(hl)], ("r8", "ind"))
        if m in ("inc", "dec") and len(ops) == 1:
            if kinds == ("r8",):
                return [(0x04 if m == "inc" else 0x05) | R8[ops[0].reg] << 3]
            if kinds == ("r16",):
                return [(0x03 if m == "inc" else 0x0B) | R16[ops[0].reg] << 4]
        if m in ALU:
            return self._alu(m, ops, kinds)
        if m == "jp":
            if len(ops) == 1 and ops[0].reg in ("hl", "[hl]"):  # jp hl (also written jp [hl])
                return [0xE9]
            if kinds == ("imm",):
                return [0xC3, *self.n16(ops[0])]
            if len(ops) == 2 and ops[1].kind == "imm" and self._cond(ops[0]) is not None:
                return [0xC2 | self._cond(ops[0]) << 3, *self.n16(ops[1])]
        if m == "jr":
            if kinds == ("imm",):
                return [0x18, self.relative(ops[0])]
            if len(ops) == 2 and ops[1].kind == "imm" and self._cond(ops[0]) is not None:
                return [0x20 | self._cond(ops[0]) << 3, self.relative(ops[1])]
        if m == "call":
            if kinds == ("imm",):
                return [0xCD, *self.n16(ops[0])]
            if len(ops) == 2 and ops[1].kind == "imm" and self._cond(ops[0]) is not None:
                return [0xC4 | self._cond(ops[0]) << 3, *self.n16(ops[1])]
        if m == "ret":
            if not ops:
                return [0xC9]
            if len(ops) == 1 and self._cond(ops[0]) is not None:
                return [0xC0 | self._cond(ops[0]) << 3]
        if m == "rst" and kinds == ("imm",):
            assert ops[0].expr is not None
            vector = self.value(ops[0].expr)
            if self.final and vector not in range(0, 0x40, 8):
                raise ValueError(f"rst vector must be one of $00, $08, ... $38, not {vector}")
            return [0xC7 | (vector & 0x38)]
        if m in ("push", "pop") and kinds in (("r16",), ("af",)) and ops[0].reg in R16_STACK:
            return [(0xC5 if m == "push" else 0xC1) | R16_STACK[ops[0].reg] << 4]
        if m in CB_SHIFTS and kinds == ("r8",):
            return [0xCB, CB_SHIFTS[m] << 3 | R8[ops[0].reg]]
        if m in CB_BITS and kinds == ("imm", "r8"):
            assert ops[0].expr is not None
            bit = self._fits(self.value(ops[0].expr), 0, 7, "bit number")
            return [0xCB, CB_BITS[m] << 6 | (bit & 7) << 3 | R8[ops[1].reg]]
        if m not in _MNEMONICS:
            raise _UnknownMnemonic(mnemonic)
        shown = ", ".join(op.text for op in ops)
        raise ValueError(f"bad operands for {mnemonic}: {shown or '(none)'}")

    @staticmethod
    def _cond(op: _Operand) -> int | None:
        name = op.text.strip().lower()
        if op.kind in ("r8", "imm") and name in CONDITIONS:
            return CONDITIONS[name]
        return None

    def _ld(self, ops: list[_Operand], kinds: tuple[str, ...]) -> list[int]:
        if len(ops) != 2:
            raise ValueError("ld takes two operands")
        dst, src = ops
        if kinds == ("r8", "r8"):
            if dst.reg == "[hl]" and src.reg == "[hl]":
                raise ValueError("ld [hl], [hl] does not exist (that opcode is halt)")
            return [0x40 | R8[dst.reg] << 3 | R8[src.reg]]
        if kinds == ("r8", "imm"):
            return [0x06 | R8[dst.reg] << 3, self.n8(src)]
        if kinds == ("r16", "imm"):
            return [0x01 | R16[dst.reg] << 4, *self.n16(src)]
        if kinds == ("ind", "r8") and src.reg == "a":
            codes = {"bc": 0x02, "de": 0x12, "hl+": 0x22, "hl-": 0x32, "c": 0xE2}
            return [codes[dst.reg]]
        if kinds == ("r8", "ind") and dst.reg == "a":
            codes = {"bc": 0x0A, "de": 0x1A, "hl+": 0x2A, "hl-": 0x3A, "c": 0xF2}
            return [codes[src.reg]]
        if kinds == ("mem", "r8") and src.reg == "a":
            return [0xEA, *self.n16(dst)]
        if kinds == ("r8", "mem") and dst.reg == "a":
            return [0xFA, *self.n16(src)]
        if kinds == ("mem", "r16") and src.reg == "sp":
            return [0x08, *self.n16(dst)]
        if kinds == ("r16", "r16") and dst.reg == "sp" and src.reg == "hl":
            return [0xF9]
        if kinds == ("r16", "spoff") and dst.reg == "hl":
            return [0xF8, self._sp_offset(src)]
        raise ValueError(f"bad operands for ld: {dst.text}, {src.text}")

    def _sp_offset(self, op: _Operand) -> int:
        assert op.expr is not None  # the expression keeps its sign: "sp-2" holds "-2"
        return self._fits(self.value(op.expr), -128, 127, "signed offset") & 0xFF

    def _ldh(self, ops: list[_Operand], kinds: tuple[str, ...]) -> list[int]:
        if kinds == ("mem", "r8") and ops[1].reg == "a":
            return [0xE0, self.high_page(ops[0])]
        if kinds == ("r8", "mem") and ops[0].reg == "a":
            return [0xF0, self.high_page(ops[1])]
        if kinds == ("ind", "r8") and ops[0].reg == "c" and ops[1].reg == "a":
            return [0xE2]
        if kinds == ("r8", "ind") and ops[0].reg == "a" and ops[1].reg == "c":
            return [0xF2]
        raise ValueError("bad operands for ldh: " + ", ".join(op.text for op in ops))

    def _alu(self, m: str, ops: list[_Operand], kinds: tuple[str, ...]) -> list[int]:
        if m == "add" and len(ops) == 2 and ops[0].kind == "r16":
            if ops[0].reg == "hl" and ops[1].kind == "r16":
                return [0x09 | R16[ops[1].reg] << 4]
            if ops[0].reg == "sp" and ops[1].kind == "imm":
                return [0xE8, self.e8(ops[1])]
            raise ValueError(f"bad operands for add: {ops[0].text}, {ops[1].text}")
        if len(ops) == 2 and ops[0].kind == "r8" and ops[0].reg == "a":
            ops = ops[1:]  # "add a, b" and "add b" are the same instruction
            kinds = kinds[1:]
        if kinds == ("r8",):
            return [0x80 | ALU[m] << 3 | R8[ops[0].reg]]
        if kinds == ("imm",):
            return [0xC6 | ALU[m] << 3, self.n8(ops[0])]
        raise ValueError(f"bad operands for {m}: " + ", ".join(op.text for op in ops))


_MNEMONICS = (
    set(SIMPLE) | set(ALU) | set(CB_SHIFTS) | set(CB_BITS)
    | {"stop", "ld", "ldh", "ldi", "ldd", "inc", "dec", "jp", "jr", "call", "ret", "rst",
       "push", "pop"}
)  # fmt: skip


# ---------------------------------------------------------------------------------------
# The assembler
# ---------------------------------------------------------------------------------------

SECTION_TYPES = {  # type -> (first address, last address, holds bytes)
    "ROM0": (0x0000, 0x7FFF, True),
    "WRAM0": (0xC000, 0xDFFF, False),
    "HRAM": (0xFF80, 0xFFFE, False),
}

_LABEL = re.compile(r"^\s*(\.?[A-Za-z_][A-Za-z0-9_]*)(::?)")
_SECTION = re.compile(
    r'^"(?P<name>[^"]*)"\s*,\s*(?P<type>[A-Za-z0-9]+)\s*(?:\[(?P<addr>[^\]]+)\])?$'
)
_EQU = re.compile(r"^(?:DEF\s+)?([A-Za-z_][A-Za-z0-9_]*)\s+EQU\s+(.+)$", re.IGNORECASE)


@dataclass
class _Line:
    number: int
    scope: str  # the global label in force, for local names
    mnemonic: str = ""
    args: str = ""
    label: str = ""


@dataclass
class _Section:
    name: str
    kind: str
    start: int
    end: int = 0  # first address after the section


@dataclass
class Assembly:
    """What `assemble` returns: the image and every symbol's value."""

    rom: bytes
    symbols: dict[str, int]
    # (name, type, first address, address after the end) of each section
    sections: list[tuple[str, str, int, int]] = field(default_factory=list)

    def used(self) -> int:
        """Bytes of ROM the sections occupy."""
        return sum(end - start for _name, kind, start, end in self.sections if kind == "ROM0")


class _Assembler:
    def __init__(self, source: str, filename: str, rom_size: int, fill: int) -> None:
        self.filename = filename
        self.rom_size = rom_size
        self.fill = fill
        self.symbols: dict[str, int] = {}
        self.constants: set[str] = set()
        self.lines = self._parse(source)

    def error(self, line: int, message: str) -> AsmError:
        return AsmError(message, self.filename, line)

    # -- reading ----------------------------------------------------------------------

    def _parse(self, source: str) -> list[_Line]:
        lines: list[_Line] = []
        scope = ""
        for number, raw in enumerate(source.splitlines(), start=1):
            text = _strip_comment(raw).rstrip()
            if not text.strip():
                continue
            equ = _EQU.match(text.strip())
            if equ:
                lines.append(_Line(number, scope, "equ", equ.group(2), equ.group(1)))
                continue
            label = ""
            match = _LABEL.match(text)
            if match:
                name = match.group(1)
                if name.startswith("."):
                    if not scope:
                        raise self.error(number, f"local label {name} before any global label")
                    label = scope + name
                else:
                    label = scope = name
                text = text[match.end() :]
            words = text.strip().split(None, 1)
            mnemonic = words[0].lower() if words else ""
            args = words[1].strip() if len(words) > 1 else ""
            lines.append(_Line(number, scope, mnemonic, args, label))
        return lines

    def _resolve(self, name: str, scope: str) -> str:
        return scope + name if name.startswith(".") else name

    def _lookup(self, scope: str, strict: bool) -> Callable[[str], int]:
        def lookup(name: str) -> int:
            full = self._resolve(name, scope)
            if full in self.symbols:
                return self.symbols[full]
            if strict:
                raise _Undefined(full)
            return 0

        return lookup

    # -- the two passes -----------------------------------------------------------------

    def run(self) -> Assembly:
        self._pass(final=False)
        image = bytearray([self.fill]) * self.rom_size
        sections = self._pass(final=True, image=image)
        return Assembly(
            bytes(image),
            dict(self.symbols),
            [(s.name, s.kind, s.start, s.end) for s in sections],
        )

    def _pass(self, final: bool, image: bytearray | None = None) -> list[_Section]:
        section: _Section | None = None
        sections: list[_Section] = []
        ends: dict[str, int] = {}
        written: dict[int, int] = {}  # ROM address -> line that wrote it
        for line in self.lines:
            pc = section.end if section else 0
            try:
                if line.mnemonic == "equ":
                    self._define_constant(line, final)
                    continue
                if line.label:
                    if section is None:
                        raise ValueError(f"label {line.label} outside any SECTION")
                    if not final:
                        if line.label in self.symbols:
                            raise ValueError(f"{line.label} is defined twice")
                        self.symbols[line.label] = pc
                if not line.mnemonic:
                    continue
                if line.mnemonic == "section":
                    section = self._open_section(line, ends, sections)
                    sections.append(section)
                    continue
                if section is None:
                    raise ValueError(f"{line.mnemonic} outside any SECTION")
                data = self._emit(line, pc, final, SECTION_TYPES[section.kind][2])
            except _Undefined as missing:
                raise self.error(line.number, f"undefined symbol {missing.name}") from None
            except _UnknownMnemonic as unknown:
                raise self.error(line.number, f"unknown mnemonic {unknown.args[0]!r}") from None
            except ValueError as bad:
                raise self.error(line.number, str(bad)) from None
            size = data if isinstance(data, int) else len(data)  # an int: reserved space
            _first, last, holds = SECTION_TYPES[section.kind]
            if pc + size - 1 > last:
                raise self.error(
                    line.number, f"section {section.name!r} runs past ${last:04X} ({section.kind})"
                )
            if final and holds and image is not None:
                payload = bytes([self.fill]) * size if isinstance(data, int) else bytes(data)
                for offset, byte in enumerate(payload):
                    address = pc + offset
                    if address in written:
                        raise self.error(
                            line.number,
                            f"${address:04X} overlaps bytes from line {written[address]}",
                        )
                    if address >= self.rom_size:
                        raise self.error(line.number, f"${address:04X} is past the ROM's end")
                    written[address] = line.number
                    image[address] = byte
            section.end = pc + size
            ends[section.kind] = section.end
        return sections

    def _define_constant(self, line: _Line, final: bool) -> None:
        name = line.label
        if final:
            return
        if name in self.symbols:
            raise ValueError(f"{name} is defined twice")
        expr = _Expr(line.args)
        self.symbols[name] = expr.evaluate(self._lookup(line.scope, strict=True), 0)
        self.constants.add(name)

    def _open_section(
        self, line: _Line, ends: dict[str, int], sections: list[_Section]
    ) -> _Section:
        match = _SECTION.match(line.args)
        if not match:
            raise ValueError('SECTION wants: SECTION "name", TYPE[$address]')
        kind = match.group("type").upper()
        if kind not in SECTION_TYPES:
            raise ValueError(f"unknown section type {kind} (use {', '.join(SECTION_TYPES)})")
        first, last, _holds = SECTION_TYPES[kind]
        if match.group("addr"):
            start = _Expr(match.group("addr")).evaluate(self._lookup(line.scope, True), 0)
        else:
            start = ends.get(kind, first)
        if not first <= start <= last:
            raise ValueError(f"{kind} section at ${start:04X} is outside ${first:04X}-${last:04X}")
        if any(s.name == match.group("name") for s in sections):
            raise ValueError(f"section {match.group('name')!r} is defined twice")
        return _Section(match.group("name"), kind, start, start)

    def _emit(self, line: _Line, pc: int, final: bool, holds: bool) -> list[int] | int:
        lookup = self._lookup(line.scope, strict=final)

        def value(expr: _Expr) -> int:
            return expr.evaluate(lookup, pc)

        m = line.mnemonic
        args = _split_commas(line.args) if line.args else []
        if m == "ds":
            if not 1 <= len(args) <= 2:
                raise ValueError("ds wants a count and an optional fill byte")
            count = _Expr(args[0]).evaluate(self._lookup(line.scope, strict=True), pc)
            if count < 0:
                raise ValueError(f"ds count {count} is negative")
            if len(args) == 2:
                if not holds:
                    raise ValueError("ds with a fill byte needs a ROM section")
                fill = _Expr(args[1]).evaluate(lookup, pc)
                return [fill & 0xFF] * count
            return count
        if not holds:
            raise ValueError(f"{m} emits bytes; RAM sections only take labels and ds")
        if m in ("db", "dw"):
            if not args:
                raise ValueError(f"{m} needs at least one value")
            out: list[int] = []
            for arg in args:
                if arg.startswith('"'):
                    if m == "dw" or len(arg) < 2 or not arg.endswith('"'):
                        raise ValueError(f"bad string {arg}")
                    out.extend(arg[1:-1].encode("ascii"))
                    continue
                number = _Expr(arg).evaluate(lookup, pc)
                if m == "db":
                    if final and not -128 <= number <= 255:
                        raise ValueError(f"db value {number} does not fit in a byte")
                    out.append(number & 0xFF)
                else:
                    if final and not -32768 <= number <= 65535:
                        raise ValueError(f"dw value {number} does not fit in 16 bits")
                    out.extend([number & 0xFF, (number >> 8) & 0xFF])
            return out
        if m not in _MNEMONICS:
            raise _UnknownMnemonic(m)
        operands = [_parse_operand(arg) for arg in args]
        return _Encoder(value, final, pc).encode(m, operands)


def assemble(
    source: str, filename: str = "<asm>", rom_size: int = 0x8000, fill: int = 0x00
) -> Assembly:
    """Assemble `source` into a `rom_size`-byte image (gaps hold `fill`).

    Raises `AsmError` ("file:line: reason") for any mistake in the source.
    """
    return _Assembler(source, filename, rom_size, fill).run()
