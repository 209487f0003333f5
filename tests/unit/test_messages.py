"""The library's messages go through logging.getLogger("dtlab"): printed as before while the program configures no
logging (information on stdout, warnings on stderr), silenced by the logger's level, routed to the program's own
handlers once it has some (`dtlab --version`: tests/integration/test_entry_point.py)."""

import logging

from dtlab.launching.replay import Replayed


def test_messages_print_as_before_until_logging_is_configured_and_a_level_silences_them(capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a program that configured no logging
    Replayed("/runs/r1", loader=lambda d: d).wait(progress=True)
    logging.getLogger("dtlab.launching.handle").warning("dtlab: a warning")
    out, err = capsys.readouterr()
    assert out == "replayed from /runs/r1 (recorded; not run again)\n" and err == "dtlab: a warning\n"
    log = logging.getLogger("dtlab")
    before = log.level
    log.setLevel(logging.ERROR)
    try:
        Replayed("/runs/r1", loader=lambda d: d).wait(progress=True)
        logging.getLogger("dtlab.launching.handle").warning("dtlab: a warning")
    finally:
        log.setLevel(before)
    assert capsys.readouterr() == ("", "")


def test_a_program_with_its_own_logging_gets_the_messages_once_through_its_handlers(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="dtlab"):
        Replayed("/runs/r1", loader=lambda d: d).wait(progress=True)
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("dtlab.launching.replay", "INFO", "replayed from /runs/r1 (recorded; not run again)")
    ]
    assert capsys.readouterr() == ("", "")  # not printed a second time
