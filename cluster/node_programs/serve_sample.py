"""On the head, for the serving section of `cluster status`: GET each Serve app's /metrics
through the head's Serve proxy, in rounds `window` seconds apart. Prints one JSON document:

    serve_sample PROXY_BASE WINDOW_S ROUNDS SCRAPE_TIMEOUT_S
    stdin: {"targets": [{"app", "path", "scrapes"}], "keep": [line prefixes]}
    {APP: [round: [{"t": monotonic seconds, "text": kept lines} | {"t", "error"}]]}

Behind one route the proxy picks a replica per request, so a target may be scraped several
times a round. Only the lines starting with one of `keep` come back (the figures the laptop
reads). Each page is stamped with the midpoint between send and receipt. The proxy is reached
directly (no HTTP proxy from the environment). Read-only. Stdlib only, Python 3.8+.
"""

import json
import sys
import time
import urllib.request

MAX_ROUNDS = 10
MAX_SCRAPES = 1000


def scrape(opener, url, timeout, keep, clock=time.monotonic):
    sent = clock()
    try:
        with opener.open(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
        lines = [line for line in text.splitlines() if line.startswith(keep)]
        return {"t": (sent + clock()) / 2, "text": "\n".join(lines)}
    except Exception as exc:
        return {"t": sent, "error": "%s: %s" % (type(exc).__name__, exc)}


def main(argv, stdin_text, clock=time.monotonic, sleep=time.sleep):
    base, window, rounds, timeout = argv[0], float(argv[1]), int(argv[2]), float(argv[3])
    if not 0 <= window <= 3600 or not 1 <= rounds <= MAX_ROUNDS or not 0 < timeout <= 600:
        raise SystemExit("serve_sample: bad window, rounds or timeout")
    spec = json.loads(stdin_text)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the local proxy
    keep = tuple(spec["keep"])
    out = {t["app"]: [] for t in spec["targets"]}
    start = clock()
    for r in range(rounds):
        wait = start + r * window - clock()
        if wait > 0:
            sleep(wait)
        for t in spec["targets"]:
            scrapes = min(int(t["scrapes"]), MAX_SCRAPES)
            out[t["app"]].append([scrape(opener, base + t["path"], timeout, keep, clock)
                                  for _ in range(scrapes)])
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1:], sys.stdin.read())) + "\n")
