"""Bounded reading of untrusted input: user files and JSON.

Everything the plugin reads from a user (``--kv-compression-config`` text or
file, an artifact's ``manifest.json``, ``calibrate --text``) goes through
here, so that a hostile or broken input is refused with one
:class:`~vllm_lowrank.config.LowRankConfigError` naming it, never an
``OverflowError``, a ``RecursionError``, a blocked ``open`` or an unbounded
read:

- :func:`read_text`: the path must be a regular file (not a directory, FIFO or
  device: checked with ``stat`` *before* opening, so a FIFO never blocks), at
  most ``max_bytes`` long, readable, and UTF-8 text without NUL bytes.
- :func:`parse_json`: nesting at most :data:`MAX_JSON_DEPTH` levels (checked by
  a scan before the recursive parser runs), integers of at most
  :data:`MAX_INT_DIGITS` digits, finite floats only (no ``NaN``/``Infinity``,
  no ``1e999``), no key twice in one object.
- :func:`layer_index`: a layer key is ASCII decimal digits only
  (``^[0-9]+$``: not ``"1_0"``, ``" 3"``, ``"+3"`` or ``"٣"``, which
  Python's ``int()`` accepts).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any

from vllm_lowrank.errors import LowRankConfigError

MAX_CONFIG_BYTES = 1 << 20
"""Largest ``--kv-compression-config`` file (1 MiB; a real one is < 1 KiB)."""
MAX_MANIFEST_BYTES = 64 << 20
"""Largest artifact ``manifest.json`` (64 MiB; SmolLM2's is about 10 KiB)."""
MAX_TEXT_BYTES = 1 << 30
"""Largest calibration text file (1 GiB)."""
MAX_TENSOR_BYTES = 1 << 38
"""Largest artifact ``bases.safetensors`` (256 GiB)."""
MAX_JSON_DEPTH = 32
"""Deepest nesting accepted in any JSON input (a manifest nests 4 levels)."""
MAX_INT_DIGITS = 19
"""Longest integer literal accepted in JSON (fits an int64)."""

_LAYER_KEY = re.compile(r"[0-9]+", re.ASCII)


def check_regular_file(path: str, what: str, max_bytes: int) -> None:
    """Refuse anything but an existing regular file of at most ``max_bytes``,
    without opening it (a FIFO or device is never opened).

    Raises:
        LowRankConfigError: missing, not a regular file, too large or unreadable.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise LowRankConfigError(f"{what} {path!r} does not exist") from None
    except (OSError, ValueError) as e:
        raise LowRankConfigError(
            f"{what} {path!r} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise LowRankConfigError(f"{what} {path!r} is {kind}; give a regular file")
    if info.st_size > max_bytes:
        raise LowRankConfigError(
            f"{what} {path!r} is {info.st_size} bytes, more than the {max_bytes} "
            "accepted; is it the right file?")
    if not os.access(path, os.R_OK):
        raise LowRankConfigError(f"{what} {path!r} cannot be read (permission denied)")


def read_text(path: str, what: str, max_bytes: int) -> str:
    """The contents of a user's text file, checked before and while reading.

    Args:
        path: The file.
        what: How messages name it (e.g. ``"--kv-compression-config file"``).
        max_bytes: Size limit.

    Raises:
        LowRankConfigError: missing, not a regular file, too large, unreadable,
            or not UTF-8 text.
    """
    check_regular_file(path, what, max_bytes)
    try:
        # O_NONBLOCK: a path swapped for a FIFO after the stat above must not block.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise LowRankConfigError(f"{what} {path!r} cannot be read ({e.strerror})") from None
    if len(data) > max_bytes:
        raise LowRankConfigError(f"{what} {path!r} is larger than {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LowRankConfigError(
            f"{what} {path!r} is not UTF-8 text (invalid byte at offset {e.start}); "
            "is it a binary file?") from None
    if "\x00" in text:
        raise LowRankConfigError(f"{what} {path!r} contains NUL bytes; is it a binary file?")
    return text


def json_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting of JSON ``text`` (brackets inside strings
    do not count); linear, no recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json(text: str, what: str) -> Any:
    """``json.loads`` within the limits of the module docstring.

    Raises:
        LowRankConfigError: malformed JSON (with its position), too deep, an
            integer too long or a non-finite number.
    """
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise LowRankConfigError(
            f"{what} nests {depth} levels deep, more than the {MAX_JSON_DEPTH} accepted")

    def parse_int(literal: str) -> int:
        if len(literal.lstrip("-")) > MAX_INT_DIGITS:
            raise LowRankConfigError(
                f"{what} has an integer of {len(literal.lstrip('-'))} digits; at most "
                f"{MAX_INT_DIGITS} are accepted")
        return int(literal)

    def parse_float(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise LowRankConfigError(f"{what} has the number {literal[:40]}, which overflows "
                                     "a float; use a finite number")
        return value

    def parse_constant(name: str) -> float:
        raise LowRankConfigError(f"{what} has {name}, which is not a JSON number; "
                                 "use a finite number")

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise LowRankConfigError(f"{what} has the key {dup!r} twice; keep one")
        return out

    try:
        return json.loads(text, parse_int=parse_int, parse_float=parse_float,
                          parse_constant=parse_constant, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as e:
        raise LowRankConfigError(
            f"{what} is malformed JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:  # unreachable after the depth scan; kept as a guard
        raise LowRankConfigError(f"{what} nests too deep") from None


def layer_index(key: Any, what: str) -> int:
    """A layer index from a JSON object key: ASCII digits only (or, from
    Python, a non-negative ``int``).

    Raises:
        LowRankConfigError: any other key (the message names ``what``).
    """
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < 10**9:
        return key
    if not isinstance(key, str) or not _LAYER_KEY.fullmatch(key) or len(key) > 9:
        raise LowRankConfigError(
            f"{what} key {key!r} is not a layer index (ASCII digits 0-9 only, e.g. \"3\")")
    return int(key)


def layer_map(raw: Any, what: str) -> dict[int, Any]:
    """``{layer: value}`` from a JSON object keyed by layer index, refusing
    keys that name one layer twice (``"3"`` and ``"03"``).

    Raises:
        LowRankConfigError: not an object, a bad key or a duplicate layer.
    """
    if not isinstance(raw, dict):
        raise LowRankConfigError(f"{what} must be an object keyed by layer index, "
                                 f"got {type(raw).__name__}")
    out: dict[int, Any] = {}
    for key, value in raw.items():
        layer = layer_index(key, what)
        if layer in out:
            raise LowRankConfigError(
                f"{what} names layer {layer} twice (keys differing only in leading "
                "zeros); keep one")
        out[layer] = value
    return out


def check_directory(path: str, what: str, fix: str = "give a directory") -> None:
    """Refuse anything but an existing directory; a file is called a file
    (not "does not exist"). Messages end with ``fix``.

    Raises:
        LowRankConfigError: missing, unreadable, or not a directory.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise LowRankConfigError(f"{what} {path!r} does not exist; {fix}") from None
    except (OSError, ValueError) as e:
        raise LowRankConfigError(f"{what} {path!r} cannot be read "
                                 f"({getattr(e, 'strerror', None) or e}); {fix}") from None
    if not stat.S_ISDIR(info.st_mode):
        kind = "a file" if stat.S_ISREG(info.st_mode) else "not a regular file"
        raise LowRankConfigError(f"{what} {path!r} is {kind}, not a directory; {fix}")


def check_writable_directory(path: str, what: str) -> None:
    """Refuse a directory that cannot be written, or created with its missing
    parents: the path or its nearest existing ancestor is not a directory, or
    is not writable.

    Raises:
        LowRankConfigError: naming the path (or the ancestor) at fault.
    """
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    check_directory(existing, what if existing == os.path.abspath(path)
                    else f"{what} {path!r}: the path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise LowRankConfigError(f"{what} {path!r} cannot be written (permission denied on "
                                 f"{existing!r})")
