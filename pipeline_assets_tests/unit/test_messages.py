"""``one_line``: the one helper that squashes a message to one line for errors and log lines."""

from __future__ import annotations

import psycopg
import pytest

from pipeline_assets.messages import one_line


def test_white_space_runs_fold_to_single_spaces():
    exc = psycopg.errors.InsufficientPrivilege("permission denied for table chunks\n\tDETAIL:  role  reader\r\n")
    assert one_line(exc) == "permission denied for table chunks DETAIL: role reader"
    assert one_line("  a\n\nb\tc  ") == "a b c"


def test_first_keeps_only_the_first_non_blank_line():
    exc = psycopg.OperationalError(
        '\nconnection to server at "127.0.0.1", port 1 failed:  Connection refused\n'
        "\tIs the server running on that host and accepting TCP/IP connections?\n"
    )
    assert one_line(exc, first=True) == 'connection to server at "127.0.0.1", port 1 failed: Connection refused'


@pytest.mark.parametrize("first", [False, True])
def test_an_exception_without_text_gives_its_type_and_text_stays_text(first):
    assert one_line(TimeoutError(), first=first) == "TimeoutError"
    assert one_line(ValueError(" \n "), first=first) == "ValueError"
    assert one_line("", first=first) == ""  # a plain string is never replaced by "str"
