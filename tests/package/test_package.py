"""Importing the package: MiniMind registered with the Auto classes, and no third-party import noise before a
command's own output (only the two known notices are dropped)."""

import logging
import subprocess
import sys

from conftest import ROOT


def test_importing_the_commands_prints_nothing():
    done = subprocess.run(
        [sys.executable, "-c", "import minimind.cli, minimind.loading, torchao"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_only_the_known_notices_are_dropped():
    import minimind  # noqa: F401

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    seen, handler = [], Collect()
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        loggers[0].warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        loggers[0].warning("Failed to quantize layer 3")
        loggers[1].warning(
            "<enum 'X'> is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
        )
        loggers[1].warning("some other pytree warning")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert seen == ["Failed to quantize layer 3", "some other pytree warning"]
