"""pdctl.ssh: what it lets paramiko print."""

from __future__ import annotations

import logging

import paramiko
import pytest

import pdctl.ssh  # noqa: F401 - importing it installs the filter under test


def test_refused_channels_are_not_printed_but_other_errors_are(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The logger and format paramiko's Transport uses for a refused direct-tcpip channel.
    logger = paramiko.util.get_logger("paramiko.transport")
    with caplog.at_level(logging.ERROR, logger="paramiko.transport"):
        logger.log(logging.ERROR, "Secsh channel %d open FAILED: %s: %s", 12, "refused", "x")
        logger.log(logging.ERROR, "Exception (client): Error reading SSH protocol banner")
    assert [r.getMessage() for r in caplog.records] == [
        "Exception (client): Error reading SSH protocol banner"
    ]
