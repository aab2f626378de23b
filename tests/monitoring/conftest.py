"""The monitoring tools (prometheus, promtool, prometheus-alertmanager, amtool).

`make test` installs them before pytest starts (infra/scripts/install-test-tools.sh); a test
that needs one fails, never skips, when it is missing, so a check cannot silently not run."""
from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest

INSTALL_HINT = "run `make test-tools` (Debian/Ubuntu: apt-get install prometheus prometheus-alertmanager)"


@dataclass(frozen=True)
class MonitoringTools:
    promtool: str
    amtool: str
    prometheus: str
    alertmanager: str  # Debian names it prometheus-alertmanager


@pytest.fixture(scope="session")
def monitoring_tools() -> MonitoringTools:
    found = {name: shutil.which(name) for name in ("promtool", "amtool", "prometheus")}
    found["alertmanager"] = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    missing = sorted(name for name, path in found.items() if path is None)
    if missing:
        pytest.fail(f"{', '.join(missing)} not on PATH: {INSTALL_HINT}")
    return MonitoringTools(**found)
