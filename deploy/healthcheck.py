#!/usr/bin/env python3
"""Container health probe: exit 0 when URL answers 2xx within the timeout, 1 otherwise.

The images carry no curl or wget (less to patch, less for an intruder to use), so the probe is
this standard-library script. URL is the first argument, else $PORTCULLIS_HEALTH_URL. Only
health routes are probed, and they need no token, so nothing secret passes through here.
"""

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/healthz"


def main() -> int:
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PORTCULLIS_HEALTH_URL", DEFAULT_URL)
    # No proxies: an HTTP_PROXY set for model downloads must not reroute a loopback probe.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=4) as response:
            return 0 if 200 <= response.status < 300 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
