"""A Prometheus endpoint over a run's meter (meter.py): `--metrics-port N`, on 127.0.0.1.

The figures are read from the meter at each scrape, so they are the ones the report's timeline
samples and the report ends with. Names follow Prometheus' conventions: a family per figure,
`_total` on counters, units in the name, a label per kind (`hpcinfer_rows_total{status="done"}`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..errors import ConfigError
from .meter import COUNTER, Meter, family

# meter family -> (Prometheus name without _total, its label, help)
FAMILIES: dict[str, tuple[str, str | None, str]] = {
    "rows": ("hpcinfer_rows", "status", "Rows by what became of them: done (written by this run), resumed, rejected"),
    "tokens": ("hpcinfer_tokens", "kind", "Tokens: input (pooling tasks), prompt and completion (generation)"),
    "windows": ("hpcinfer_windows_committed", None, "Output windows committed (the output's manifest)"),
    "stage_busy_s": ("hpcinfer_stage_busy_seconds", "stage", "Seconds each pipeline stage was busy"),
    "step_busy_s": ("hpcinfer_step_busy_seconds", "part", "Seconds of engine steps, by part of the step"),
    "device_rows": ("hpcinfer_device_rows", "device", "Rows each device answered"),
    "device_tokens": ("hpcinfer_device_tokens", "device", "Tokens each device answered"),
    "breaker_state": ("hpcinfer_device_breaker_state", "device", "Circuit breaker: 0 closed, 1 half-open, 2 open"),
    "steps": ("hpcinfer_engine_steps", None, "Engine steps"),
    "occupancy_sum": ("hpcinfer_batch_occupancy_sum", None, "Sum over steps of sequences in the step / max-num-seqs"),
    "batch_occupancy": ("hpcinfer_batch_occupancy", None, "The latest step's sequences / max-num-seqs"),
    "preemptions": ("hpcinfer_preemptions", None, "Sequences preempted for want of KV blocks"),
    "prefix_cache_hit_tokens": ("hpcinfer_prefix_cache_hit_tokens", None, "Prompt tokens served from the prefix cache"),
    "running": ("hpcinfer_running_sequences", None, "Sequences in the engines' running batch"),
    "waiting": ("hpcinfer_waiting_sequences", None, "Sequences admitted, waiting for the running batch"),
    "kv_blocks_used": ("hpcinfer_kv_blocks_used", None, "KV cache blocks in use"),
    "kv_blocks_total": ("hpcinfer_kv_blocks", None, "KV cache blocks in the pool"),
}


class MeterCollector:
    """A prometheus_client collector reading the meter at each scrape."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter

    def collect(self) -> Iterator[Metric]:
        values = self.meter.read()
        grouped: dict[str, list[tuple[str | None, float]]] = {}
        for name, value in sorted(values.items()):
            head, label = family(name)
            if head in FAMILIES:
                grouped.setdefault(head, []).append((label, value))
        for head, samples in grouped.items():
            prom, label_name, help_text = FAMILIES[head]
            counter = self.meter.kinds.get(f"{head}.{samples[0][0]}" if samples[0][0] else head) == COUNTER
            kind: Any = CounterMetricFamily if counter else GaugeMetricFamily
            labels = [label_name] if label_name else []
            metric = kind(prom, help_text, labels=labels)
            for label, value in samples:
                metric.add_metric([label] if label_name and label is not None else [], value)
            yield metric


class MetricsServer:
    """Serves the meter on 127.0.0.1:`port` until `close`."""

    def __init__(self, meter: Meter, port: int, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(MeterCollector(meter))  # type: ignore[arg-type]
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:  # NOTE: before the run starts: nothing is lost
            reason = exc.strerror or str(exc)
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({reason})") from None
        self.port = self.server.server_port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
