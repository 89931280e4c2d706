"""The ctypes binding of kernel.c, read from kernel.c itself: one source of truth for every
signature and for the `layer` struct. Each exported (non-static) function's parameter names and
types, and the struct's fields, are parsed from the C text the library is built from; calls pass
arguments by the C parameter names, so a missing, extra or misspelt argument is a TypeError naming
it, never a shifted argument. At load, the library must report the source it was built from
(`source_id`) and the struct's size (`layer_size`) the Python side computes: otherwise a clear
error, not memory corruption."""

from __future__ import annotations

import ctypes
import hashlib
import re
from typing import Any, NamedTuple

SCALARS = {
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "long": ctypes.c_long,
    "unsigned long long": ctypes.c_ulonglong,
}
_FUNCTION = re.compile(
    r"^(void|int|float|double|long|unsigned long long)\s+(\w+)\(([^)]*)\)\s*\{", re.M
)
_STRUCT = re.compile(r"typedef struct \{(.*?)\} layer;", re.S)


class Signature(NamedTuple):
    result: Any  # a ctypes type, or None for void
    names: tuple[str, ...]
    types: tuple[Any, ...]


def source_id(source: str) -> int:
    """The number a library built from `source` reports (compiled in with -DRLOO_SOURCE_ID)."""
    return int(hashlib.sha256(source.encode()).hexdigest()[:15], 16)


def _ctype(declaration: str) -> tuple[str, Any]:
    """'const float *const *ws' -> ('ws', c_void_p); 'int rows' -> ('rows', c_int)."""
    declaration = " ".join(declaration.split())
    name = re.search(r"(\w+)$", declaration).group(1)
    kind = declaration[: -len(name)].replace("const", "").strip()
    if "*" in kind:
        return name, ctypes.c_void_p
    if kind not in SCALARS:
        raise ValueError(
            f"kernel.c: parameter {declaration!r} has a type the binding does not know"
        )
    return name, SCALARS[kind]


def functions(source: str) -> dict[str, Signature]:
    """Every exported function of the C source (static ones are internal)."""
    found = {}
    for result, name, parameters in _FUNCTION.findall(source):
        parts = [part for part in parameters.split(",") if part.strip() not in ("", "void")]
        pairs = [_ctype(part) for part in parts]
        found[name] = Signature(
            None if result == "void" else SCALARS[result],
            tuple(n for n, _ in pairs),
            tuple(t for _, t in pairs),
        )
    return found


def layer_struct(source: str) -> type[ctypes.Structure]:
    """The `layer` struct as a ctypes Structure, its fields in the C's order."""
    body = _STRUCT.search(source)
    if body is None:
        raise ValueError("kernel.c: no `typedef struct {...} layer;`")
    fields = []
    for statement in body.group(1).split(";"):
        statement = " ".join(statement.split())
        if not statement:
            continue
        words = statement.split()
        kind = "const " + words[1] if words[0] == "const" else words[0]
        for declarator in statement[len(kind) :].split(","):
            name, ctype = _ctype(kind + " " + declarator)
            fields.append((name, ctype))
    return type("Layer", (ctypes.Structure,), {"_fields_": fields})


class Library:
    """A loaded kernel library whose functions take keyword arguments named as in kernel.c."""

    def __init__(self, path: str, source: str):
        self._cdll = ctypes.CDLL(path)
        self._signatures = functions(source)
        for name, signature in self._signatures.items():
            function = getattr(self._cdll, name)
            function.argtypes, function.restype = list(signature.types), signature.result
        self.Layer = layer_struct(source)
        built_from = self._cdll.source_id()
        if built_from != source_id(source):
            raise RuntimeError(
                f"kernel library {path} was built from another kernel.c (source id {built_from:x}, "
                f"expected {source_id(source):x}). Fix: delete it; it is rebuilt on next use."
            )
        if self._cdll.layer_size() != ctypes.sizeof(self.Layer):
            raise RuntimeError(
                f"kernel library {path}: the C `layer` struct is {self._cdll.layer_size()} bytes, "
                f"its binding {ctypes.sizeof(self.Layer)}: kernel.c's struct and the parser "
                "disagree."
            )

    def __getattr__(self, name: str):
        signature = self._signatures.get(name)
        if signature is None:
            raise AttributeError(f"kernel.c exports no function {name!r}")
        function = getattr(self._cdll, name)

        def call(*positional, **arguments):
            if positional:
                raise TypeError(f"kernel {name}: pass arguments by their C names {signature.names}")
            missing = [n for n in signature.names if n not in arguments]
            extra = sorted(set(arguments) - set(signature.names))
            if missing or extra:
                raise TypeError(
                    f"kernel {name}: missing {missing}, unknown {extra} (kernel.c's parameters: "
                    f"{', '.join(signature.names)})"
                )
            return function(*(arguments[n] for n in signature.names))

        return call
