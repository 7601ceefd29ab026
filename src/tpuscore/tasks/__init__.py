"""Workloads over the engine: ranking and log-likelihood. Host logic only; no import of the
facade."""
