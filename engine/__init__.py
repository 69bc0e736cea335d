"""crossover engine package."""
