"""crossover tuner package."""
