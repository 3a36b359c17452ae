"""A real browser for integration tests: Debian's `chromium`, headless (scripts/bootstrap installs it).

    with Browser(tmp_path) as browser:
        dom = browser.dom("http://127.0.0.1:PORT/#/serve")       # the DOM after its scripts ran
        png = browser.screenshot("http://127.0.0.1:PORT/#/serve", "dashboard-serve")

Each call is one `chromium --headless=new --no-sandbox --disable-gpu` process with a bounded
timeout and virtual time budget, a private --user-data-dir under the test's tmp folder (kept
for inspection: `browser.profile`), no proxy and Chromium's own background traffic off (only
the page's URL is fetched). Screenshots go to $CLUSTER_TEST_OUTPUT (default <repo>/.test-output/)
so they stay with the run's output; their paths are printed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from fakes import output_dir   # where the suite keeps what a person looks at afterwards

REPO = Path(__file__).resolve().parents[2]
BUDGET_MS = 20000        # virtual time the page's scripts get (timers, fetches) before the dump
TIMEOUT_S = 180.0        # wall-clock limit of one chromium run
WINDOW = "1400,1000"
QUIET = ["--no-first-run", "--no-default-browser-check", "--disable-extensions",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-domain-reliability", "--metrics-recording-only",
         "--disable-client-side-phishing-detection", "--disable-dev-shm-usage",
         "--no-proxy-server", "--password-store=basic", "--use-mock-keychain"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def chromium_unavailable() -> str | None:
    """Why no browser test can run here, or None."""
    if chromium() is None:
        return "no chromium on PATH (scripts/bootstrap installs Debian's `chromium` as root)"
    return None




class BrowserError(AssertionError):
    """chromium failed or did not finish in time (the message has its stderr's tail)."""


class Browser:
    """Headless chromium runs sharing one private profile folder under `tmp`."""

    def __init__(self, tmp: Path, budget_ms: int = BUDGET_MS, timeout_s: float = TIMEOUT_S):
        self.profile = Path(tmp) / "chromium-profile"
        self.profile.mkdir(parents=True, exist_ok=True)
        self.budget_ms = budget_ms
        self.timeout_s = timeout_s
        self.pids: list[int] = []   # every chromium run's pid (argv sweeps read them)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _run(self, url: str, *mode: str) -> str:
        exe = chromium()
        if exe is None:
            raise BrowserError(chromium_unavailable())
        argv = [exe, "--headless=new", "--no-sandbox", "--disable-gpu", *QUIET,
                f"--user-data-dir={self.profile}", f"--virtual-time-budget={self.budget_ms}",
                *mode, url]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace",
                                start_new_session=True)
        self.pids.append(proc.pid)
        try:
            out, err = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            raise BrowserError(f"chromium did not finish {url} within {self.timeout_s:g} s: "
                               f"{_tail(err)}") from None
        if proc.returncode != 0:
            raise BrowserError(f"chromium exited {proc.returncode} on {url}: {_tail(err)}")
        return out

    def dom(self, url: str) -> str:
        """The page's serialized DOM once its virtual time budget is spent."""
        return self._run(url, "--dump-dom")

    def screenshot(self, url: str, name: str) -> Path:
        """A PNG of the page at 1400x1000 in output_dir(), named `name`.png; prints its path."""
        path = output_dir() / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.png"
        path.unlink(missing_ok=True)
        self._run(url, f"--screenshot={path}", f"--window-size={WINDOW}",
                  "--hide-scrollbars")
        if not path.is_file() or path.stat().st_size == 0:
            raise BrowserError(f"chromium wrote no screenshot of {url} to {path}")
        print(f"screenshot: {path}")
        return path


def _tail(text: str, lines: int = 8) -> str:
    kept = [line for line in (text or "").splitlines() if "dbus" not in line.lower()]
    return " | ".join(kept[-lines:]) or "(no stderr)"


def visible_text(dom: str) -> str:
    """The DOM's text without tags, scripts and styles (what the page shows, roughly)."""
    dom = re.sub(r"(?is)<(script|style)\b[^>]*>.*?</\1\s*>", " ", dom)
    return " ".join(re.sub(r"<[^>]*>", " ", dom).split())
