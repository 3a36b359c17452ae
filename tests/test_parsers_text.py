"""cluster.inspection.parsers._lines is the one text clean-up module: prompts, ANSI colours, CRLF and
numbers, for the NVIDIA parsers as for the others (_nvidia_text keeps only the NVIDIA tools'
own words: tool failures, N/A placeholders, command echoes)."""

from __future__ import annotations

import math

import pytest

from cluster.base.errors import ParseError
from cluster.inspection.parsers import _lines, _nvidia_text


def test_the_clean_up_lives_in_one_module():
    for name in ("lines_of", "strip_prompt", "to_number", "_ANSI", "_PROMPT", "_NUMBER"):
        assert not hasattr(_nvidia_text, name)



def test_the_nvidia_parsers_read_a_bus_id_with_one_pattern():
    """nvidia-smi's table, -q, --query-gpu and nvlink -s read a PCI bus id the same way."""
    import re

    from cluster.inspection.parsers import nvidia_smi, nvidia_smi_nvlink, nvidia_smi_q, nvidia_smi_query

    for text, ok in (("00000000:17:00.0", True), ("0000:CA:00.7", True), ("17:00.0", False),
                     ("000000000:17:00.0", False), ("0000:17:00", False)):
        assert bool(re.fullmatch(_nvidia_text.BUS_ID, text)) is ok, text
    for module in (nvidia_smi, nvidia_smi_q, nvidia_smi_nvlink, nvidia_smi_query):
        assert module.BUS_ID is _nvidia_text.BUS_ID, module.__name__


@pytest.mark.parametrize("line, want", [
    ("$ nvidia-smi", "nvidia-smi"), ("# nvidia-smi -q", "nvidia-smi -q"),
    ("root@gpu1:~# nvidia-smi topo -m", "nvidia-smi topo -m"),
    ("[user@h ~]$ nvcc --version", "nvcc --version"),
    ("(base) [user@h ~]$ nvidia-smi", "nvidia-smi"), ("bash-5.2# nvidia-smi", "nvidia-smi"),
    ("PS C:\\> nvidia-smi", "nvidia-smi"), ("C:\\Users\\x> nvidia-smi", "nvidia-smi"),
    ("> nvidia-smi", "nvidia-smi"), ("user@h:~$", ""), ("#", ""),
    ("GPU 0: NVIDIA H100 (UUID: GPU-1)", "GPU 0: NVIDIA H100 (UUID: GPU-1)"),
    ("Attached GPUs : 8", "Attached GPUs : 8"),
])
def test_strip_prompt(line, want):
    assert _lines.strip_prompt(line) == want


@pytest.mark.parametrize("text, want", [
    ("42", 42), ("-7", -7), ("83.92", 83.92), ("2.0", 2.0), ("1e-9", 1e-9), (".5", 0.5),
    (" 12 ", 12), ("1e400", None), ("nan", None), ("inf", None), ("1_000", None), ("0x10", None),
    ("", None), ("9" * 41, None), ("9" * 40, int("9" * 40)),
])
def test_to_number(text, want):
    got = _lines.to_number(text)
    assert got == want and type(got) is type(want)


def test_lines_of_normalises_crlf_ansi_bom_and_no_break_spaces():
    text = "\ufeff\x1b[1;32mGPU\x1b[0m\xa00 \r\nsecond\rthird\x07\n"
    assert _lines.lines_of(text, "k") == ["GPU 0", "second", "third", ""]
    for bad in (None, b"x", "", " \n\t"):
        with pytest.raises(ParseError):
            _lines.lines_of(bad, "k")  # type: ignore[arg-type]
    assert math.isfinite(_lines.to_number("1e308"))


def test_normalize_text_drops_the_controls_of_ascii_text_without_the_pattern(monkeypatch):
    """ASCII text (most tool output) loses its control characters through str.translate, ~8x
    faster than the pattern (which tests each character in the regex engine); other text still
    goes through the pattern (translate is slower there); both give the same text."""
    text = "GPU 0\x07\r\n    Name\x08 : A100\x0b\x0c\x7f\x01\t1\n"
    expected = _lines._CONTROL_RE.sub("", text.replace("\r\n", "\n"))
    used = []
    real = _lines._CONTROL_RE

    class Spy:
        def sub(self, repl, string):
            used.append(string)
            return real.sub(repl, string)

    monkeypatch.setattr(_lines, "_CONTROL_RE", Spy())
    assert _lines.normalize_text(text) == expected == "GPU 0\n    Name : A100\t1\n"
    assert used == []
    assert _lines.normalize_text(text + "\u00e9\x01") == expected + "\u00e9"
    assert len(used) == 1
