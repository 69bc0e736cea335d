"""crossover daemon package."""
