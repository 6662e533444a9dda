"""The values a user picks between: backend kinds, sanitizer modes, pool modes.

Kept apart from everything else so that the pytest plugin can validate its options without importing torch.
"""

BACKEND_NAMES = ("auto", "cuda", "sim")
SANITIZE_MODES = ("off", "on", "strict")
POOL_MODES = ("auto", "mempool", "handle")
