"""`errors.headline`: the one line of an error that warnings and reports quote."""

from openppo.errors import RunFailure, headline


def test_the_first_line_without_the_colon_that_introduces_the_details():
    error = RunFailure("worker group 'actor' rank 1 (pid 7 on 10.0.0.2) died in 'train':\n  last log lines:\n  ...")
    assert headline(error) == "worker group 'actor' rank 1 (pid 7 on 10.0.0.2) died in 'train'"
    assert headline("  one line only  ") == "one line only"
    assert headline("ratio 1:2 is fine") == "ratio 1:2 is fine"  # only a trailing colon goes
    assert headline("ends with colons ::") == "ends with colons"


def test_an_empty_message_gives_the_default():
    assert headline(RuntimeError()) == "no details"
    assert headline(ValueError(""), "ValueError") == "ValueError"
    assert headline("\n\n", "") == ""
