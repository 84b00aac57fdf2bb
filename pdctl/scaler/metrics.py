"""The scaler's own Prometheus metrics: what it wants, what runs, what it decided and did."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.desired = Gauge(
            "pdctl_scaler_desired_replicas", "Replicas the policy wants", ["group"], registry=r
        )
        self.running = Gauge(
            "pdctl_scaler_running_replicas", "Replicas whose unit is active", ["group"], registry=r
        )
        self.rps = Gauge(
            "pdctl_scaler_rps", "Client requests per second through the router", registry=r
        )
        self.signal = Gauge(
            "pdctl_scaler_signal_value",
            "The deciding signal's observed value (rps, or seconds for ttft/itl)",
            ["group", "signal"],
            registry=r,
        )
        self.target = Gauge(
            "pdctl_scaler_signal_target",
            "The deciding signal's target (rps per replica, or seconds for ttft/itl)",
            ["group", "signal"],
            registry=r,
        )
        self.queue = Gauge(
            "pdctl_scaler_queue_per_replica",
            "Requests waiting per routed replica (the workers' own gauge)",
            ["group"],
            registry=r,
        )
        self.decisions = Counter(
            "pdctl_scaler_decisions", "Decisions by action", ["group", "action"], registry=r
        )
        self.actions = Histogram(
            "pdctl_scaler_action_seconds", "Time an action took", ["action"], registry=r
        )
        self.failures = Counter(
            "pdctl_scaler_action_failures", "Actions that failed", ["action"], registry=r
        )
        self.lost = Gauge(
            "pdctl_scaler_host_lost",
            "1 while a worker host is lost (its replicas replaced elsewhere)",
            ["host"],
            registry=r,
        )
        self.replaced = Counter(
            "pdctl_scaler_replaced",
            "Replicas replaced for not answering",
            ["group", "reason"],
            registry=r,
        )


def serve_metrics(metrics: Metrics, host: str, port: int) -> None:
    start_http_server(port, addr=host, registry=metrics.registry)
