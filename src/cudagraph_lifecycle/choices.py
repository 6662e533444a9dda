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
