"""crossover telemetry package."""
