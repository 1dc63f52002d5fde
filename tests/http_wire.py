"""Raw HTTP calls to the HTTP door (what a client other than the openai package sends) and /metrics samples."""
from __future__ import annotations

import http.client
import json
import ssl

from prometheus_client.parser import text_string_to_metric_families


def post(port: int, path: str, body: bytes | dict | list, headers: dict[str, str] | None = None,
         method: str = "POST", context: ssl.SSLContext | None = None) -> tuple[int, dict, dict[str, str]]:
    """(status, JSON body or {"raw": text}, lower-cased headers)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = (http.client.HTTPSConnection("localhost", port, timeout=60, context=context) if context
            else http.client.HTTPConnection("127.0.0.1", port, timeout=60))
    try:
        conn.request(method, path, body=data if method == "POST" else None,
                     headers={"content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"raw": raw.decode(errors="replace")}
        return response.status, parsed, {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def metrics(port: int) -> dict[str, list]:
    """/metrics parsed by prometheus_client, samples by name (a counter's family drops its _total)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def metric_value(samples: dict, name: str, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))
