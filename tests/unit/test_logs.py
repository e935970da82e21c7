"""service/logs.py: JSON and text lines carry the request's fields, control characters are escaped (no forged
lines), and a rate-limited line says how many it left out."""

from __future__ import annotations

import json
import logging

from tokenloop.service.logs import JsonFormatter, LineBudget, RateLimitedLog, TextFormatter, bounded, escape_controls


def test_json_and_text_log_lines_carry_the_request_fields():
    record = logging.LogRecord("tokenloop.requests", logging.INFO, __file__, 1, "request end", (), None)
    record.request_id, record.status, record.output_tokens = "abc", "OK", 7
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request end" and line["request_id"] == "abc" and line["output_tokens"] == 7
    assert line["level"] == "INFO" and line["time"].endswith("Z")
    assert TextFormatter().format(record).endswith("request end request_id=abc status=OK output_tokens=7")


def test_control_characters_are_escaped_in_text_log_lines():
    assert escape_controls("plain id-1") == "plain id-1"
    assert escape_controls("a\nb\x1b[31mc\x00\u2028") == "a\\nb\\x1b[31mc\\x00\\u2028"
    record = logging.LogRecord("tokenloop.requests", logging.INFO, __file__, 1, "request %s failed", ("x\ny",), None)
    record.request_id = "evil\n2026-12-05 00:00:00 INFO forged: line\x1b[2J\x00"
    record.peer = "ipv4:127.0.0.1:5 status=OK"
    line = TextFormatter().format(record)
    assert "\n" not in line and "\x1b" not in line and "\x00" not in line
    assert line.endswith(' request x\\ny failed request_id="evil\\n2026-12-05 00:00:00 INFO forged: line\\x1b[2J\\x00"'
                         ' peer="ipv4:127.0.0.1:5 status=OK"')


def test_rate_limited_log_says_how_many_it_left_out(caplog):
    now = [100.0]
    limited = RateLimitedLog(logging.getLogger("tokenloop.test"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tokenloop.test"):
        assert limited.warning("refused %s", "a")
        assert [limited.warning("refused %s", "b") for _ in range(40)] == [False] * 40
        now[0] += 10.5
        assert limited.warning("refused %s", "c")
    assert [r.getMessage() for r in caplog.records] == ["refused a", "refused c (and 40 more like it in the last 10s)"]


def test_client_values_reach_a_line_bounded_in_either_format():
    record = logging.LogRecord("tokenloop.requests", logging.INFO, __file__, 1, "request %s", ("m" * 20_000,), None)
    record.request_id = "r" * 7000 + "\n"
    text = TextFormatter().format(record)
    assert len(text) < 4096 + 256 + 200 and "\n" not in text
    assert "request_id=" + "r" * 256 + "...[cut: 7001 characters]" in text
    assert "request " + "m" * 4088 + "...[cut: 20008 characters]" in text
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "r" * 256 + "...[cut: 7001 characters]"
    assert len(line["message"]) < 4200
    assert bounded("\x00" * 300) == "\\x00" * 256 + "...[cut: 300 characters]"


def test_a_traceback_keeps_its_lines_each_bounded():
    try:
        raise OSError("File name too long: " + "a" * 100_000)
    except OSError:
        import sys
        record = logging.LogRecord("tokenloop.service", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = TextFormatter().format(record)
    assert "Traceback" in text and len(text) < 6000 and text.endswith("...[cut: 100029 characters]")


def test_a_tracebacks_lines_are_escaped_like_client_values():
    """A client's text in an exception (an ESC that recolours the terminal, a carriage return that hides the line,
    a U+2028) is escaped in the text format, each line of the traceback kept; JSON escapes it itself."""
    import sys
    try:
        raise ValueError("unknown adapter 'x\x1b[2J\rINFO forged\u2028y'")
    except ValueError:
        record = logging.LogRecord("tokenloop.service", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = TextFormatter().format(record)
    assert text.splitlines()[-1] == "ValueError: unknown adapter 'x\\x1b[2J\\rINFO forged\\u2028y'"
    assert "\x1b" not in text and "\r" not in text and "\u2028" not in text and "Traceback" in text
    record.exc_text = None  # the formatter caches the traceback's text on the record
    line = json.loads(JsonFormatter().format(record))
    assert line["exception"].endswith("ValueError: unknown adapter 'x\x1b[2J\rINFO forged\u2028y'")


def test_failed_request_lines_share_a_budget():
    now = [0.0]
    budget = LineBudget(rate=5.0, burst=50.0, clock=lambda: now[0])
    assert sum(budget.take() for _ in range(1000)) == 50  # a burst, then nothing
    assert budget.left_out() == 950 and budget.left_out() == 0
    now[0] += 2.0
    assert sum(budget.take() for _ in range(1000)) == 10  # 5 a second
    now[0] += 1000.0
    assert sum(budget.take() for _ in range(1000)) == 50  # never more than the burst
    budget.take()
    budget.reset()
    assert sum(budget.take() for _ in range(100)) == 50 and budget.left_out() == 50
