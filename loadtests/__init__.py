"""Locust load tests for kvharbor: workload, canaries, shapes, runner and summary (docs/loadtests.md)."""
