"""The Server-Timing header: written in ms from seconds, read back, and other servers' forms read."""

from __future__ import annotations

from cluster.observability.server_timing import parse_server_timing, server_timing


def test_written_in_milliseconds_in_a_fixed_order() -> None:
    value = server_timing(0.000152, 0.0, 0.000655, 0.001102)
    assert value == "prep;dur=0.152, queue;dur=0.000, upstream;dur=0.655, ttft;dur=1.102"
    assert parse_server_timing(value) == {"prep": 0.152, "queue": 0.0, "upstream": 0.655, "ttft": 1.102}


def test_a_negative_clock_difference_is_shown_as_zero() -> None:
    assert parse_server_timing(server_timing(-1e-6, 0.0, 0.0, 0.0))["prep"] == 0.0


def test_other_servers_forms_are_read_and_what_has_no_number_is_left_out() -> None:
    value = 'cache;desc="Cache Read";dur=23.2, db;dur="53", miss, total;dur=abc, ;dur=1'
    assert parse_server_timing(value) == {"cache": 23.2, "db": 53.0}
    assert parse_server_timing(None) == {} and parse_server_timing("") == {}
