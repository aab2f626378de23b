"""The monitoring tools (promtool, amtool, prometheus, alertmanager), installed when missing."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

DEBIAN_PACKAGES = ("prometheus", "prometheus-alertmanager")
INSTALL_HINT = "sudo apt-get install -y --no-install-recommends " + " ".join(DEBIAN_PACKAGES)


@dataclass(frozen=True)
class MonitoringTools:
    promtool: str
    amtool: str | None  # from prometheus-alertmanager; its checks skip without it
    prometheus: str | None = None
    alertmanager: str | None = None  # Debian names it prometheus-alertmanager


def _install_debian_packages() -> None:
    """`apt-get install` the packages without starting their services: `policy-rc.d`
    answering 101 is Debian's way to tell maintainer scripts not to start anything."""
    if shutil.which("apt-get") is None:
        pytest.fail(f"promtool is not on PATH and this is not a Debian system: install Prometheus's promtool "
                    f"and Alertmanager's amtool (Debian/Ubuntu: {INSTALL_HINT})")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}
    policy = Path("/usr/sbin/policy-rc.d")
    created = not policy.exists()
    if created:
        policy.write_text("#!/bin/sh\n# tests/monitoring: start no service during apt-get install\nexit 101\n")
        policy.chmod(0o755)
    try:
        install = ["apt-get", "install", "-y", "--no-install-recommends", *DEBIAN_PACKAGES]
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:  # stale package lists on a fresh machine
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=300)
            result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if created:
            policy.unlink()
    if result.returncode != 0:
        pytest.fail(f"{' '.join(install)} exited {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


@pytest.fixture(scope="session")
def monitoring_tools() -> MonitoringTools:
    if shutil.which("promtool") is None:
        if os.geteuid() != 0:
            pytest.fail(f"promtool is not on PATH; install it (Debian/Ubuntu: {INSTALL_HINT}) and rerun")
        _install_debian_packages()
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(f"promtool is still missing after installing {', '.join(DEBIAN_PACKAGES)}")
    return MonitoringTools(promtool, shutil.which("amtool"), shutil.which("prometheus"),
                           shutil.which("prometheus-alertmanager") or shutil.which("alertmanager"))


