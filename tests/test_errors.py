"""core/errors.py: text from files and artifacts made printable."""

from __future__ import annotations


def test_bidi_overrides_and_line_separators_are_escaped_too():
    from cafa_cli.core.errors import printable

    assert printable("evil\u202egnp.exe\u2028x\u00a0é") == "evil\\u202egnp.exe\\u2028x\u00a0é"
    assert printable("می\u200cخواهم") == "می\u200cخواهم"  # the joiner Persian words need is not escaped
