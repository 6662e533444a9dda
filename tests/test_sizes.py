"""Sizes as users write them (options, ini keys, marker arguments) and as messages show them."""

import pytest

from cudagraph_lifecycle.sizes import NegativeSizeError, parse_size, size_text

TAKEN = [("64MiB", 64 << 20), (" 5 MiB ", 5 << 20), ("1.5GB", 1_500_000_000), ("0.5KiB", 512), ("12", 12),
         ("4096b", 4096), ("2gib", 2 << 30), (4096, 4096), ("9" * 30, int("9" * 30))]  # exact, however long
REFUSED = ["lots", "5 parsecs", "64MB5", "1e3", "1.5", "0.3KiB", "１２", "", "MiB", True]
NEGATIVE = ["-5MiB", "-0", " - 1", -1]
SHOWN = [(0, "0 bytes"), (1, "1 byte"), (1023, "1023 bytes"), (1024, "1 KiB (1024 bytes)"),
         (1536, "1.5 KiB (1536 bytes)"), ((1 << 20) - 1, "1 MiB (1048575 bytes)"),
         (20 << 20, "20 MiB (20971520 bytes)"), (100_000 << 30, "100000 GiB (107374182400000 bytes)"),
         (-(1 << 20), "-1 MiB (-1048576 bytes)")]


@pytest.mark.parametrize("text, n", TAKEN)
def test_sizes_taken(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", REFUSED)
def test_what_is_not_a_size_is_refused(text):
    with pytest.raises(ValueError) as e:
        parse_size(text)
    assert not isinstance(e.value, NegativeSizeError)


@pytest.mark.parametrize("text", NEGATIVE)
def test_a_minus_sign_is_said_to_be_negative(text):
    with pytest.raises(NegativeSizeError):
        parse_size(text)


@pytest.mark.parametrize("n, words", SHOWN)
def test_sizes_shown_in_a_unit_chosen_after_rounding_with_the_exact_bytes(n, words):
    assert size_text(n) == words
