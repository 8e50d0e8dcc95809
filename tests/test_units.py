"""Human sizes and durations."""

from __future__ import annotations

import pytest

from cachebuild.units import format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("1024", 1024), ("64k", 64 << 10), ("64K", 64 << 10), ("512M", 512 << 20),
    ("20G", 20 << 30), ("20GB", 20 << 30), ("20GiB", 20 << 30), ("1.5G", 3 << 29),
    ("2T", 2 << 40), (" 3 M ", 3 << 20), ("100B", 100), ("1.0 KiB", 1024),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "-1G", "20X", "20 G B", "1e3", "ten", "1..5G", "1.5",
                                  "1.5B"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 4096, 1 << 20, 3 << 29, 20 << 30, 5 << 40])
def test_format_size_round_trips(n):
    text = format_size(n)
    # one decimal place: within 5% of the original, and exact below 1 KiB
    assert abs(parse_size(text) - n) <= max(n * 0.05, 0)


def test_format_size_examples():
    assert format_size(512) == "512 B"
    assert format_size(4096) == "4.0 KiB"
    assert format_size(3 << 29) == "1.5 GiB"


@pytest.mark.parametrize("text, expected", [
    ("7d", 7 * 86400), ("12h", 12 * 3600), ("30m", 1800), ("90s", 90), ("300", 300),
    ("2w", 14 * 86400), ("1h30m", 5400), ("1h 30m", 5400), ("1.5h", 5400), ("250ms", 0.25),
    ("1D", 86400),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "d", "7x", "-1d", "7d ago", "1h30", "h1"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize("seconds, text", [
    (0.25, "250ms"), (5, "5.0s"), (45, "45s"), (200, "3m 20s"), (3600, "1h"),
    (2 * 86400 + 4 * 3600 + 59, "2d 4h"), (7 * 86400, "1w"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [45, 200, 3600, 5400, 7 * 86400, 90061])
def test_format_duration_parses_back(seconds):
    # at most two units are shown, so the round trip is exact up to the dropped unit
    assert parse_duration(format_duration(seconds)) <= seconds
    assert parse_duration(format_duration(seconds)) >= seconds - 3600
