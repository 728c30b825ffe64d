"""The documentation stays true: every flag that README.md or docs/ show for a script is one it accepts."""

import glob
import os
import re

import pytest

from conftest import ROOT, load_script

DOCS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "data", "README.md"),
        *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
COMMAND = re.compile(r"python scripts/(\w+)\.py([^`\n|#]*)")  # up to a code span's end, a table cell or a comment
FLAG = re.compile(r"(?<!\S)--[A-Za-z][\w-]*")


def documented_flags():
    flags = {}
    for path in DOCS:
        text = open(path, encoding="utf-8").read().replace("\\\n", " ")  # shell line continuations
        for script, rest in COMMAND.findall(text):
            flags.setdefault(script, set()).update(FLAG.findall(rest))
    return flags


DOCUMENTED = documented_flags()


def test_docs_show_every_script():
    scripts = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "scripts", "*.py"))}
    assert scripts <= set(DOCUMENTED), f"scripts without a documented example: {sorted(scripts - set(DOCUMENTED))}"


@pytest.mark.parametrize("script", sorted(DOCUMENTED))
def test_documented_flags_are_accepted(script, capsys):
    module = load_script(script)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    unknown = sorted(flag for flag in DOCUMENTED[script] if not re.search(re.escape(flag) + r"(?![\w-])", help_text))
    assert not unknown, f"scripts/{script}.py --help does not list {unknown}"
