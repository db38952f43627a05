"""What the workers tell the outside: structlog set-up, OpenTelemetry spans, Prometheus metric
definitions. Imports only `settings` and `protocol`."""
