"""The one rule for names that reach the filesystem or routing: model names, version strings
and file paths inside a model directory.

A model name is ONE path component that stays inside the repository: non-empty, no ``/``,
``\\`` or NUL, not ``.`` or ``..`` (so never absolute either). It is checked on the decoded
name: the HTTP front end percent-decodes each path part once, gRPC names arrive as raw strings,
so ``%2Ftmp%2Fx`` and ``..%2f..%2fx`` are refused like ``/tmp/x`` and ``../../x``. A version is
decimal digits, or empty for "latest". A violation is ``InferError.invalid`` (HTTP 400, gRPC
INVALID_ARGUMENT) naming the rule and the offending value; the checks never touch the filesystem.

Symlinks: the repository's own entries are the operator's (as in Triton, a model directory may
be a symlink and is followed); a client can only ever select a direct entry of the repository by
name. Files a client names inside a model directory (``file:<path>`` load overrides) must stay
inside it after resolving symlinks (``model_file_path``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import NoReturn

__all__ = ["NAME_MAX", "NAME_RULE", "check_file_path", "check_model_name", "check_region_name", "check_shm_key",
           "check_version", "is_valid_model_name", "model_file_path"]

NAME_MAX = 255  # bytes of UTF-8: the longest file name Linux file systems hold (and /dev/shm)
NAME_RULE = ("a model name must be one path component: non-empty, at most 255 bytes of UTF-8, without '/', '\\', "
             "NUL or other control characters, not '.' or '..'")
# separators and every control character: C0 (NUL, newline, ESC...), DEL and C1. Control
# characters are refused so that a name never breaks a text log line or a terminal.
_FORBIDDEN = re.compile(r"[/\\\x00-\x1f\x7f-\x9f]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _invalid(message: str) -> NoReturn:
    # imported here: the repository package stays importable without grpc (errors.py needs it)
    from meshserve.protocol.errors import InferError

    raise InferError.invalid(message)


def is_valid_model_name(name: str) -> bool:
    """True when ``name`` is a single path component that stays inside the repository, at
    most NAME_MAX bytes of UTF-8, without control characters."""
    return (bool(name) and name != "." and name != ".." and _FORBIDDEN.search(name) is None
            and _fits(name))


def _fits(name: str) -> bool:
    """At most NAME_MAX bytes of UTF-8 (and encodable: a lone surrogate is no file name)."""
    if len(name) <= NAME_MAX // 4:  # 4 bytes per character at most: no need to encode
        return True
    try:
        return len(name.encode()) <= NAME_MAX
    except UnicodeEncodeError:
        return False


def check_model_name(name: str, what: str = "model name") -> str:
    """``name`` when valid; else InferError.invalid naming the rule and the name."""
    if not is_valid_model_name(name):
        _invalid(f"invalid {what} {_shown(name)}: {_why(name)}")
    return name


_TRIMMED = " \t\n\v\f\r"  # (boost::trim's whitespace in the C locale)


def check_load_name(name: str) -> str:
    """A model name a load request gives: Triton's checks and words first (core's
    model_repository_manager.cc, ValidateModelName, on load only; NVIDIA's L0_input_validation
    asserts them), the rule named after them: empty once trimmed of whitespace, or ".." or a '/'
    in it once trimmed; then ``check_model_name``'s rule."""
    trimmed = name.strip(_TRIMMED)
    if not trimmed:
        _invalid(f"Model name cannot be empty. Please enter a valid name to deploy. ({NAME_RULE})")
    if trimmed == ".." or "/" in trimmed:
        _invalid(f"invalid model name {_shown(name)}, model name must not contain path traversal characters "
                 f"({NAME_RULE})")
    return check_model_name(name)


def _why(name: str) -> str:
    if not name:
        return "it is empty"
    if name in (".", ".."):
        return f"'{name}' is not allowed ({NAME_RULE})"
    bad = _FORBIDDEN.search(name)
    if bad is None:
        return f"{_length(name)} ({NAME_RULE})"
    char = bad.group()
    shown = {"/": "'/'", "\\": "'\\'", "\x00": "NUL"}.get(char, f"the control character U+{ord(char):04X}")
    return f"it contains {shown} ({NAME_RULE})"


def _shown(name: str) -> str:
    """``name`` quoted for an error, its first 64 characters when longer."""
    return repr(name) if len(name) <= 64 else f"{name[:64]!r}... ({len(name)} characters)"


def _length(name: str) -> str:
    try:
        return f"it is {len(name.encode())} bytes long, longer than {NAME_MAX}"
    except UnicodeEncodeError:
        return "it is not valid UTF-8"


def check_region_name(name: str) -> str:
    """A shared-memory region's name, as a client gives it (register): at most NAME_MAX bytes
    of UTF-8, no control characters (it is a key, never a path: '/' is allowed, as in Triton).
    InferError.invalid otherwise."""
    if name.isascii() and name.isprintable() and len(name) <= NAME_MAX:
        return name  # the common case, without the regex (requests naming regions check it too)
    bad = _CONTROL.search(name)
    if bad is not None or not _fits(name):
        why = f"it contains the control character U+{ord(bad.group()):04X}" if bad else _length(name)
        _invalid(f"invalid shared-memory region name {_shown(name)}: {why} (a region name is at most {NAME_MAX} bytes "
                 "of UTF-8, without control characters)")
    return name


def check_version(version: str, model: str = "") -> str:
    """``version`` when it is decimal digits or empty (latest); else InferError.invalid, whose
    message begins as Triton's (NVIDIA's grpc_explicit_int8_content_client.py looks for it)."""
    if version and not (version.isascii() and version.isdigit() and len(version) <= NAME_MAX):
        of = f" of model {model!r}" if model else ""
        shown = f"'{version}'" if version.isprintable() and len(version) <= 64 else _shown(version)
        _invalid(f"failed to get model version from specified version string {shown}{of}: invalid version, "
                 f"a version must be decimal digits (at most {NAME_MAX}; or empty for the latest)")
    return version


def check_file_path(relative: str) -> list[str]:
    """The components of a file path a client names inside a model directory (``1/model.onnx``
    of a ``file:1/model.onnx`` load override), each checked by the name rule. Leading ``/`` stand
    for the model directory, as in Triton, which joins the name to the directory (core's JoinPath
    appends an absolute segment: ``file:/1/model.py`` is ``1/model.py``; NVIDIA's
    qa/L0_backend_python/model_control sends it so). Pure (no filesystem): the gateway checks
    with it before forwarding."""
    inside = relative.lstrip("/")
    if not inside or inside.startswith("\\") or re.match(r"^[A-Za-z]:", inside):
        _invalid(f"invalid file path {relative!r}: it must be a path inside the model directory")
    parts = inside.split("/")
    for part in parts:
        check_model_name(part, f"file path {relative!r} component")
    return parts


def model_file_path(model_dir: str | Path, relative: str) -> Path:
    """The path of a file a client names inside ``model_dir`` (e.g. ``1/model.onnx`` of a
    ``file:1/model.onnx`` load override): every component must pass the name rule, the path
    must be relative, and it must still be inside ``model_dir`` after resolving symlinks."""
    parts = check_file_path(relative)
    base = Path(model_dir).resolve()
    target = base.joinpath(*parts).resolve()
    if not target.is_relative_to(base):
        _invalid(f"invalid file path {relative!r}: it resolves outside the model directory")
    return target


SHM_KEY_MAX = NAME_MAX  # the longest file name /dev/shm holds


def check_shm_key(key: str) -> str:
    """The file name under /dev/shm of a POSIX shared-memory key a client registers (the
    system shared-memory extension): leading ``/`` are dropped, as glibc's ``shm_open`` does
    (``/input0`` and ``input0`` are the same object), and what remains must pass the name rule,
    so a key never names a file outside /dev/shm. InferError.invalid otherwise."""
    name = key.lstrip("/")
    if not is_valid_model_name(name):  # one name of at most NAME_MAX bytes
        why = _why(name)
        _invalid(f"invalid shared-memory key {_shown(key)}: {why} (a key is one name under /dev/shm, "
                 "optionally with a leading '/')")
    return name
