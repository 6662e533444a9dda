"""The values a user picks between: backend kinds, sanitizer modes, pool modes.

Kept apart from everything else so that the pytest plugin can validate its options without importing torch.
"""

BACKEND_NAMES = ("auto", "cuda", "sim")
SANITIZE_MODES = ("off", "on", "strict")
POOL_MODES = ("auto", "mempool", "handle")
# what the sanitizer does with the reset of a pool's last graph while blocks of it live, under
# expandable_segments:True (a crash once those blocks are freed): refuse it, or only report it
EXPANDABLE_TEARDOWN = ("refuse", "report")
# CUDAGRAPH_SANITIZE values that install no program-wide sanitizer
SANITIZE_ENV_OFF = ("", "0", "off", "false", "no")


def checked_from_env(environ) -> bool:
    """``CUDAGRAPH_CHECKED``: checked mode for every runner that does not choose; anything but a boolean is an
    error naming the variable."""
    from .errors import ConfigError

    raw = environ.get("CUDAGRAPH_CHECKED", "")
    value = raw.strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("", "0", "false", "off", "no"):
        return False
    raise ConfigError(f"CUDAGRAPH_CHECKED={raw!r} is not a boolean: set it to 1 (checked mode for every runner that "
                      "does not choose) or 0, or unset it")


# CUDAGRAPH_CAPTURE_PATH: how the observation layer runs capture_begin's common path; ``auto`` takes the
# compiled one where it was built (an optional extension) and Python otherwise
CAPTURE_PATHS = ("auto", "compiled", "python")


def capture_path_from_env(environ) -> str:
    """``CUDAGRAPH_CAPTURE_PATH``: ``auto`` (unset too), ``compiled`` or ``python``; anything else is an error
    naming the variable."""
    from .errors import ConfigError

    raw = environ.get("CUDAGRAPH_CAPTURE_PATH", "")
    value = raw.strip().lower() or "auto"
    if value not in CAPTURE_PATHS:
        raise ConfigError(f"CUDAGRAPH_CAPTURE_PATH={raw!r} is not one of {', '.join(CAPTURE_PATHS)}: set it to "
                          "'python' to observe captures in Python only, 'compiled' to require the compiled path "
                          "(an error where it was not built), or unset it")
    return value


def compiled_or_python(environ, missing: str | None, what: str) -> str:
    """``compiled`` or ``python``: what ``CUDAGRAPH_CAPTURE_PATH`` chooses for a part built optionally at
    install (``what``, as an error names it), ``missing`` saying why it is not there (None where it is);
    ``compiled`` where it was not built is an error that says why."""
    from .errors import ConfigError

    chosen = capture_path_from_env(environ)
    if chosen == "python":
        return "python"
    if missing is not None:
        if chosen == "compiled":
            raise ConfigError(f"CUDAGRAPH_CAPTURE_PATH=compiled, but {what} was not built ({missing}): reinstall "
                              "where a C compiler and Python's headers are present (from a clone: pip install "
                              "--no-deps -e .), or unset the variable")
        return "python"
    return "compiled"
