"""crossover store package."""
